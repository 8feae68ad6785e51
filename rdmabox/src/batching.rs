//! Merging and chaining decisions: how a drained batch of requests becomes work requests and
//! post calls. Pure functions over request descriptors, so every decision is unit-tested.
//!
//! The paper's Algorithm 2, corrected (as printed, both branches `continue` and the post is never
//! reached): walking the batch in remote-address order, a request that starts where the current
//! work request ends, in the same region, joins it (merging-on-MR: one work request); any other
//! request opens a new work request chained behind the current one (doorbell chaining: one post
//! call); a chain is posted when it is full, and at the end of the batch.

/// What the planner needs to know of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// Key of the remote region: requests merge only within one region.
    pub rkey: u32,
    /// Remote start address.
    pub addr: u64,
    /// Bytes to transfer.
    pub len: usize,
    /// Carried by a registered caller buffer (one SGE of its own) rather than copied into a
    /// pre-registered staging buffer (where adjacent requests share one SGE).
    pub dynamic: bool,
}

/// The planner's switches and limits: the session's settings and its queue pairs' caps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// Merge requests adjacent in remote memory into one work request.
    pub merge: bool,
    /// Post several work requests with one call (doorbell chaining).
    pub chain: bool,
    /// Work requests per post call.
    pub max_chain: usize,
    /// Bytes one merged work request may carry.
    pub max_merge_bytes: usize,
    /// Staged bytes one work request may carry (a staging buffer's size).
    pub max_staged_bytes: usize,
    /// Scatter/gather elements one work request may carry.
    pub max_sge: usize,
}

/// Indices into the batch: requests merged into one work request.
pub type Group = Vec<usize>;
/// Work requests posted with one call.
pub type Chain = Vec<Group>;

/// SGEs a group needs: one per dynamic member, one per run of staged members.
fn sges_of(batch: &[Desc], group: &[usize]) -> usize {
    let mut n = 0;
    let mut in_run = false;
    for &i in group {
        if batch[i].dynamic {
            n += 1;
            in_run = false;
        } else if !in_run {
            n += 1;
            in_run = true;
        }
    }
    n
}

fn staged_bytes(batch: &[Desc], group: &[usize]) -> usize {
    group
        .iter()
        .filter(|&&i| !batch[i].dynamic)
        .map(|&i| batch[i].len)
        .sum()
}

/// Splits a batch into chains of work requests.
pub fn plan(batch: &[Desc], cfg: &PlanConfig) -> Vec<Chain> {
    let mut order: Vec<usize> = (0..batch.len()).collect();
    if cfg.merge {
        // Stable: requests to the same address keep their submission order.
        order.sort_by_key(|&i| (batch[i].rkey, batch[i].addr));
    }
    let mut groups: Vec<Group> = Vec::new();
    for i in order {
        let d = &batch[i];
        if let Some(g) = groups.last_mut().filter(|_| cfg.merge) {
            let last = &batch[*g.last().expect("groups are never empty")];
            let total: usize = g.iter().map(|&j| batch[j].len).sum::<usize>() + d.len;
            let adjacent = last.rkey == d.rkey && last.addr + last.len as u64 == d.addr;
            if adjacent && total <= cfg.max_merge_bytes {
                g.push(i);
                let fits = sges_of(batch, g) <= cfg.max_sge
                    && staged_bytes(batch, g) <= cfg.max_staged_bytes;
                if fits {
                    continue;
                }
                g.pop();
            }
        }
        groups.push(vec![i]);
    }
    let per_chain = if cfg.chain { cfg.max_chain.max(1) } else { 1 };
    let mut chains: Vec<Chain> = Vec::new();
    for g in groups {
        match chains.last_mut() {
            Some(c) if c.len() < per_chain => c.push(g),
            _ => chains.push(vec![g]),
        }
    }
    chains
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PlanConfig {
        PlanConfig {
            merge: true,
            chain: true,
            max_chain: 32,
            max_merge_bytes: 1 << 20,
            max_staged_bytes: 1 << 20,
            max_sge: 4,
        }
    }

    fn d(addr: u64, len: usize) -> Desc {
        Desc {
            rkey: 1,
            addr,
            len,
            dynamic: false,
        }
    }

    #[test]
    fn a_lone_request_is_one_work_request() {
        assert_eq!(plan(&[d(0, 4096)], &cfg()), vec![vec![vec![0]]]);
    }

    #[test]
    fn adjacent_requests_merge_even_out_of_order() {
        let batch = [d(8192, 4096), d(0, 4096), d(4096, 4096)];
        assert_eq!(plan(&batch, &cfg()), vec![vec![vec![1, 2, 0]]]);
    }

    #[test]
    fn gaps_and_other_regions_chain_instead() {
        let mut other = d(4096, 4096);
        other.rkey = 2;
        let batch = [d(0, 4096), d(8192, 4096), other];
        assert_eq!(plan(&batch, &cfg()), vec![vec![vec![0], vec![1], vec![2]]]);
    }

    #[test]
    fn chains_hold_at_most_max_chain_work_requests() {
        let batch: Vec<_> = (0..70).map(|i| d(i * 8192, 4096)).collect();
        let chains = plan(&batch, &cfg());
        assert_eq!(
            chains.iter().map(|c| c.len()).collect::<Vec<_>>(),
            [32, 32, 6]
        );
    }

    #[test]
    fn merging_stops_at_the_byte_limit() {
        let c = PlanConfig {
            max_merge_bytes: 8192,
            ..cfg()
        };
        let batch: Vec<_> = (0..4).map(|i| d(i * 4096, 4096)).collect();
        assert_eq!(plan(&batch, &c), vec![vec![vec![0, 1], vec![2, 3]]]);
    }

    #[test]
    fn dynamic_members_take_an_sge_each_and_respect_the_device_limit() {
        let c = PlanConfig {
            max_sge: 2,
            ..cfg()
        };
        let mut batch: Vec<_> = (0..3).map(|i| d(i * 4096, 4096)).collect();
        for x in &mut batch {
            x.dynamic = true;
        }
        assert_eq!(plan(&batch, &c), vec![vec![vec![0, 1], vec![2]]]);
        // Staged neighbours share one SGE, so they do not hit the limit.
        let staged: Vec<_> = (0..3).map(|i| d(i * 4096, 4096)).collect();
        assert_eq!(plan(&staged, &c), vec![vec![vec![0, 1, 2]]]);
    }

    #[test]
    fn staged_bytes_fit_one_staging_buffer() {
        let c = PlanConfig {
            max_staged_bytes: 4096,
            ..cfg()
        };
        let batch = [d(0, 4096), d(4096, 4096)];
        assert_eq!(plan(&batch, &c), vec![vec![vec![0], vec![1]]]);
    }

    #[test]
    fn switches_off_independently() {
        let batch = [d(0, 4096), d(4096, 4096), d(100_000, 4096)];
        let no_merge = PlanConfig {
            merge: false,
            ..cfg()
        };
        assert_eq!(
            plan(&batch, &no_merge),
            vec![vec![vec![0], vec![1], vec![2]]]
        );
        let no_chain = PlanConfig {
            chain: false,
            ..cfg()
        };
        assert_eq!(
            plan(&batch, &no_chain),
            vec![vec![vec![0, 1]], vec![vec![2]]]
        );
        let neither = PlanConfig {
            merge: false,
            chain: false,
            ..cfg()
        };
        assert_eq!(plan(&batch, &neither).len(), 3);
    }

    #[test]
    fn same_address_keeps_submission_order() {
        let batch = [d(4096, 4096), d(0, 4096), d(4096, 4096)];
        let chains = plan(&batch, &cfg());
        let flat: Vec<usize> = chains.concat().concat();
        let first = flat.iter().position(|&i| i == 0).unwrap();
        let second = flat.iter().position(|&i| i == 2).unwrap();
        assert!(first < second);
    }
}
