//! One DP rank's prefix cache (SGLang's radix cache, as far as routing can tell): which
//! leading pages of a prompt's KV a rank still holds, with LRU eviction to a capacity.
//!
//! Why: a router that sends a conversation's next turn to the rank that computed the
//! earlier turns saves prefill time; the simulator must reward that (a shorter prefill, a
//! shorter KV wait on the decode) and report it (`cached_tokens`) as SGLang does, so
//! benches can measure a cache-aware policy without GPUs.
//!
//! Model: a prompt's token ids are cut into pages of `page_size` tokens; page `i` is keyed
//! by a hash chain, `key(i) = hash(key(i - 1), tokens of page i)`, so a key names the page
//! *and everything before it*, like a radix-tree node. A prompt's cached prefix is the
//! longest run of its leading pages present.
//!
//! Invariants:
//! - Only whole pages count: a cached prefix is a multiple of `page_size`, and the match
//!   looks at all tokens but the last (SGLang computes the last prompt token whatever the
//!   cache holds: its logits give the first output token; `Req::adjust_max_prefix_ids`),
//!   so `cached ≤ len - 1` and a trailing partial page is never reported as cached.
//! - At most `capacity / page_size` pages are held (capacity in tokens; 0 = no cache:
//!   nothing is stored, every match is 0).
//! - Eviction takes the least recently used *leaf* (a page no cached page continues), so a
//!   held page's whole prefix is held too and no capacity goes to unreachable pages; a
//!   match or insert touches the pages it walks, deeper ones last.
//! - Never panics, whatever the input (hash collisions only make a page look present).

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// One cached page.
#[derive(Debug, Clone)]
struct Page {
    /// The key of the page before it (`None`: the prompt's first page).
    parent: Option<u64>,
    /// Cached pages that continue this one.
    children: u32,
    /// Last use (unique per page: ticks only grow).
    tick: u64,
}

/// A DP rank's prefix cache; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct PrefixCache {
    page_size: usize,
    max_pages: usize,
    pages: HashMap<u64, Page>,
    /// Pages without cached children, by last use (the eviction order).
    leaves: BTreeMap<u64, u64>,
    tick: u64,
}

/// The key of a page that follows `prev` (`None`: the first page) and holds `tokens`.
fn page_key(prev: Option<u64>, tokens: &[i64]) -> u64 {
    let mut h = DefaultHasher::new();
    prev.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// A cache of `capacity_tokens` tokens (rounded down to whole pages) in pages of
    /// `page_size` tokens (0 counts as 1).
    pub(crate) fn new(capacity_tokens: u64, page_size: u32) -> Self {
        let page_size = page_size.max(1);
        let max_pages =
            usize::try_from(capacity_tokens / u64::from(page_size)).unwrap_or(usize::MAX);
        PrefixCache {
            page_size: page_size as usize,
            max_pages,
            pages: HashMap::new(),
            leaves: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Tokens held now (whole pages).
    #[cfg(test)]
    fn len_tokens(&self) -> u64 {
        (self.pages.len() as u64).saturating_mul(self.page_size as u64)
    }

    /// The keys of `tokens`' whole pages, in order.
    fn keys<'a>(&self, tokens: &'a [i64]) -> impl Iterator<Item = u64> + 'a {
        let mut prev = None;
        tokens.chunks_exact(self.page_size).map(move |page| {
            let key = page_key(prev, page);
            prev = Some(key);
            key
        })
    }

    /// Marks `key` as just used.
    fn touch(&mut self, key: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(p) = self.pages.get_mut(&key) {
            if p.children == 0 {
                self.leaves.remove(&p.tick);
                self.leaves.insert(tick, key);
            }
            p.tick = tick;
        }
    }

    /// Evicts the least recently used leaf other than `keep`; false if there is none.
    fn evict_one(&mut self, keep: Option<u64>) -> bool {
        let Some((&tick, &key)) = self.leaves.iter().find(|(_, k)| Some(**k) != keep) else {
            return false;
        };
        self.leaves.remove(&tick);
        let parent = self.pages.remove(&key).and_then(|p| p.parent);
        if let Some(pk) = parent {
            if let Some(pp) = self.pages.get_mut(&pk) {
                pp.children = pp.children.saturating_sub(1);
                if pp.children == 0 {
                    self.leaves.insert(pp.tick, pk);
                }
            }
        }
        true
    }

    /// The cached prefix of `tokens`, in tokens (see the module invariants); touches the
    /// pages it matched.
    pub(crate) fn match_prefix(&mut self, tokens: &[i64]) -> u32 {
        if self.max_pages == 0 {
            return 0;
        }
        let considered = &tokens[..tokens.len().saturating_sub(1)];
        let hits: Vec<u64> = self
            .keys(considered)
            .take_while(|k| self.pages.contains_key(k))
            .collect();
        for k in &hits {
            self.touch(*k);
        }
        u32::try_from(hits.len().saturating_mul(self.page_size)).unwrap_or(u32::MAX)
    }

    /// What [`match_prefix`](Self::match_prefix) would answer now, without touching
    /// anything (a load report's look at a queued prompt must not change the eviction order).
    pub(crate) fn peek_prefix(&self, tokens: &[i64]) -> u32 {
        if self.max_pages == 0 {
            return 0;
        }
        let considered = &tokens[..tokens.len().saturating_sub(1)];
        let hits = self
            .keys(considered)
            .take_while(|k| self.pages.contains_key(k))
            .count();
        u32::try_from(hits.saturating_mul(self.page_size)).unwrap_or(u32::MAX)
    }

    /// Stores `tokens`' whole pages (the leading ones that fit), evicting least recently
    /// used leaves as needed; pages already held are touched.
    pub(crate) fn insert(&mut self, tokens: &[i64]) {
        if self.max_pages == 0 {
            return;
        }
        let keys: Vec<u64> = self.keys(tokens).take(self.max_pages).collect();
        let mut prev: Option<u64> = None;
        for key in keys {
            if self.pages.contains_key(&key) {
                self.touch(key);
                prev = Some(key);
                continue;
            }
            while self.pages.len() >= self.max_pages {
                if !self.evict_one(prev) {
                    return;
                }
            }
            if let Some(pk) = prev {
                let Some(pp) = self.pages.get_mut(&pk) else {
                    // Only a hash collision could take the parent away: stop here.
                    return;
                };
                if pp.children == 0 {
                    self.leaves.remove(&pp.tick);
                }
                pp.children = pp.children.saturating_add(1);
            }
            self.tick += 1;
            self.pages.insert(
                key,
                Page {
                    parent: prev,
                    children: 0,
                    tick: self.tick,
                },
            );
            self.leaves.insert(self.tick, key);
            prev = Some(key);
        }
    }

    /// [`match_prefix`](Self::match_prefix), then [`insert`](Self::insert): the cached
    /// tokens of `tokens` before this call.
    pub(crate) fn match_and_insert(&mut self, tokens: &[i64]) -> u32 {
        let cached = self.match_prefix(tokens);
        self.insert(tokens);
        cached
    }

    /// Checks the internal links (tests): every leaf is listed once by its tick, every
    /// child count is right, every parent is held.
    #[cfg(test)]
    fn check(&self) -> Result<(), String> {
        let mut children: HashMap<u64, u32> = HashMap::new();
        for p in self.pages.values() {
            if let Some(pk) = p.parent {
                if !self.pages.contains_key(&pk) {
                    return Err("a page's parent is not held".into());
                }
                *children.entry(pk).or_default() += 1;
            }
        }
        for (k, p) in &self.pages {
            let want = children.get(k).copied().unwrap_or(0);
            if p.children != want {
                return Err(format!("children {} != {want}", p.children));
            }
            let listed = self.leaves.get(&p.tick) == Some(k);
            if listed != (want == 0) {
                return Err(format!("leaf listing {listed} for {want} children"));
            }
        }
        let leaf_count = self.pages.values().filter(|p| p.children == 0).count();
        if self.leaves.len() != leaf_count {
            return Err(format!(
                "{} leaves listed, {leaf_count} held",
                self.leaves.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn toks(range: std::ops::Range<i64>) -> Vec<i64> {
        range.collect()
    }

    fn cat(a: &[i64], b: &[i64]) -> Vec<i64> {
        let mut v = a.to_vec();
        v.extend_from_slice(b);
        v
    }

    struct Case {
        name: &'static str,
        capacity: u64,
        page: u32,
        /// Each prompt in turn (`match_and_insert`) and the cached tokens it must report.
        steps: Vec<(Vec<i64>, u32)>,
    }

    #[test]
    fn table() {
        let a40 = toks(0..40);
        let shared = cat(&toks(0..32), &toks(100..120));
        let cases = vec![
            Case {
                name: "an empty cache holds nothing",
                capacity: 1000,
                page: 16,
                steps: vec![(a40.clone(), 0)],
            },
            Case {
                name: "a repeated prompt: its whole pages but the last token's",
                capacity: 1000,
                page: 16,
                steps: vec![(a40.clone(), 0), (a40.clone(), 32), (a40.clone(), 32)],
            },
            Case {
                name: "a prompt of whole pages: the last token is always computed",
                capacity: 1000,
                page: 16,
                steps: vec![(toks(0..32), 0), (toks(0..32), 16), (toks(0..33), 32)],
            },
            Case {
                name: "a shared prefix counts up to the first differing page",
                capacity: 1000,
                page: 16,
                steps: vec![(a40.clone(), 0), (shared.clone(), 32), (toks(0..20), 16)],
            },
            Case {
                name: "a difference in the first page shares nothing",
                capacity: 1000,
                page: 16,
                steps: vec![(a40.clone(), 0), (cat(&[7], &toks(1..40)), 0)],
            },
            Case {
                name: "partial pages never count",
                capacity: 1000,
                page: 16,
                steps: vec![
                    (toks(0..15), 0),
                    (toks(0..15), 0),
                    (toks(0..16), 0),
                    (toks(0..17), 16),
                ],
            },
            Case {
                name: "capacity 0 is no cache",
                capacity: 0,
                page: 16,
                steps: vec![(a40.clone(), 0), (a40.clone(), 0)],
            },
            Case {
                name: "capacity below a page is no cache",
                capacity: 15,
                page: 16,
                steps: vec![(a40.clone(), 0), (a40.clone(), 0)],
            },
            Case {
                name: "page size 0 counts as 1",
                capacity: 1000,
                page: 0,
                steps: vec![(toks(0..5), 0), (toks(0..5), 4)],
            },
            Case {
                name: "a prompt longer than the capacity keeps its leading pages",
                capacity: 32,
                page: 16,
                steps: vec![(toks(0..80), 0), (toks(0..80), 32)],
            },
            Case {
                // Two pages of room; A, B, then A again (A is now newer than B), then C
                // evicts B, the least recently used: A still hits, B misses.
                name: "eviction takes the least recently used",
                capacity: 32,
                page: 16,
                steps: vec![
                    (toks(0..17), 0),
                    (toks(100..117), 0),
                    (toks(0..17), 16),
                    (toks(200..217), 0),
                    (toks(0..17), 16),
                    (toks(100..117), 0),
                ],
            },
            Case {
                // A is two pages; B shares A's first page. With three pages of room and
                // A's tail the oldest leaf, C (one page) evicts A's tail, not the shared
                // first page that B still continues.
                name: "eviction takes leaves, never a page another continues",
                capacity: 48,
                page: 16,
                steps: vec![
                    (toks(0..33), 0),
                    (cat(&toks(0..16), &toks(500..517)), 16),
                    (toks(300..317), 0),
                    (cat(&toks(0..16), &toks(500..517)), 32),
                    (toks(0..33), 16),
                ],
            },
        ];
        for case in cases {
            let mut c = PrefixCache::new(case.capacity, case.page);
            for (i, (prompt, want)) in case.steps.iter().enumerate() {
                let got = c.match_and_insert(prompt);
                assert_eq!(got, *want, "{}: step {i}", case.name);
                assert!(c.len_tokens() <= case.capacity, "{}: step {i}", case.name);
                assert_eq!(c.check(), Ok(()), "{}: step {i}", case.name);
            }
        }
    }

    #[test]
    fn match_alone_does_not_insert() {
        let mut c = PrefixCache::new(1000, 4);
        assert_eq!(c.match_prefix(&toks(0..10)), 0);
        assert_eq!(c.match_prefix(&toks(0..10)), 0);
        c.insert(&toks(0..10));
        assert_eq!(c.len_tokens(), 8);
        assert_eq!(c.match_prefix(&toks(0..10)), 8);
        assert_eq!(c.match_prefix(&[]), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever the prompts (a small alphabet, so prefixes are shared often), the
        /// capacity and the page size: cached ≤ len - 1, a whole number of pages, the
        /// cache within its capacity, its links consistent, and a prompt just inserted
        /// found as far as the capacity allows.
        #[test]
        fn invariants(
            capacity in 0u64..200,
            page in 0u32..9,
            prompts in prop::collection::vec(prop::collection::vec(0i64..3, 0..60), 1..40),
        ) {
            let mut c = PrefixCache::new(capacity, page);
            let ps = page.max(1) as usize;
            let max_pages = (capacity / u64::from(page.max(1))) as usize;
            for p in &prompts {
                // A peek (`&self`: it changes nothing) answers what the match then finds.
                let peeked = c.peek_prefix(p) as usize;
                let cached = c.match_and_insert(p) as usize;
                prop_assert_eq!(peeked, cached);
                prop_assert!(cached <= p.len().saturating_sub(1));
                prop_assert_eq!(cached % ps, 0);
                prop_assert!(c.len_tokens() <= capacity);
                prop_assert_eq!(c.check(), Ok(()));
                let again = c.match_prefix(p) as usize;
                let want = (p.len().saturating_sub(1) / ps).min(max_pages) * ps;
                prop_assert_eq!(again, want);
            }
        }
    }
}
