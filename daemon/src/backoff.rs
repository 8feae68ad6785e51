//! Pauses between attempts: each twice the one before, from a first pause up to a last one.
//! Every retry loop of the client and the nodes waits this way.

use std::time::Duration;

/// The pauses of one retry loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    next: Duration,
    last: Duration,
}

impl Backoff {
    /// Pauses from `first`, doubling, up to `last`.
    pub const fn new(first: Duration, last: Duration) -> Backoff {
        Backoff {
            first,
            next: first,
            last,
        }
    }

    /// The pause before the next attempt; the one after it is twice as long (up to the last).
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(self.last);
        pause
    }

    /// The pause [`Self::next_pause`] would give, without taking it.
    pub fn peek(&self) -> Duration {
        self.next
    }

    /// Starts again from the first pause (something happened that the loop waited for).
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_the_last_and_start_again_on_reset() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(20), ms(100));
        let got: Vec<_> = (0..5).map(|_| b.next_pause()).collect();
        assert_eq!(got, [ms(20), ms(40), ms(80), ms(100), ms(100)]);
        assert_eq!(b.peek(), ms(100));
        b.reset();
        assert_eq!(b.next_pause(), ms(20));
    }
}
