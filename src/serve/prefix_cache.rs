//! Exact prefix-state reuse.
//!
//! A Mamba state summarises its whole prefix, so the state after tokens `t[..n]` (with
//! the logits of position `n-1`) lets any prompt that starts with `t[..n]` be prefilled
//! from position `n` only — a continued window, exact in this engine. Entries are keyed
//! by their token prefix in a radix tree: a lookup walks the prompt once and returns the
//! longest cached prefix, plus how far the prompt agrees with *any* cached key (where two
//! prompts branch — the scheduler snapshots there, so the third prompt sharing that prefix
//! hits). Any position can be a cache point; there are no blocks.
//!
//! Memory is bounded: each entry costs its state's bytes, its logits row and its key; the
//! least recently used entries are evicted to keep the total within the budget, and an
//! entry larger than the whole budget is not stored.

use crate::engine::State;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Bookkeeping bytes counted per entry on top of its state, logits and key.
const ENTRY_OVERHEAD: usize = 256;

struct Node {
    /// Tokens on the edge from the parent.
    edge: Vec<u32>,
    parent: usize,
    children: HashMap<u32, usize>,
    entry: Option<usize>,
}

struct Entry {
    node: usize,
    len: usize,
    state: State,
    logits: Arc<Vec<f32>>,
    bytes: usize,
    tick: u64,
}

/// A cached prefix that a prompt starts with.
pub struct Hit {
    /// Tokens covered.
    pub len: usize,
    /// The state after them (a copy-on-write snapshot).
    pub state: State,
    /// Logits of the last covered token (`vocab_size` entries).
    pub logits: Arc<Vec<f32>>,
}

pub struct Lookup {
    pub hit: Option<Hit>,
    /// Length of the longest common prefix of the prompt with any cached key.
    pub shared: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub budget: usize,
    pub evictions: u64,
}

pub struct PrefixCache {
    budget: usize,
    used: usize,
    nodes: Vec<Option<Node>>,
    free_nodes: Vec<usize>,
    entries: Vec<Option<Entry>>,
    free_entries: Vec<usize>,
    lru: BTreeMap<u64, usize>,
    tick: u64,
    evictions: u64,
}

fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    pub fn new(budget_bytes: usize) -> PrefixCache {
        PrefixCache {
            budget: budget_bytes,
            used: 0,
            nodes: vec![Some(Node {
                edge: Vec::new(),
                parent: 0,
                children: HashMap::new(),
                entry: None,
            })],
            free_nodes: Vec::new(),
            entries: Vec::new(),
            free_entries: Vec::new(),
            lru: BTreeMap::new(),
            tick: 0,
            evictions: 0,
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            entries: self.lru.len(),
            bytes: self.used,
            budget: self.budget,
            evictions: self.evictions,
        }
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("live node")
    }
    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("live node")
    }

    fn touch(&mut self, e: usize) {
        self.tick += 1;
        let entry = self.entries[e].as_mut().expect("live entry");
        self.lru.remove(&entry.tick);
        entry.tick = self.tick;
        self.lru.insert(self.tick, e);
    }

    /// The entry of the longest cached prefix of `tokens`, and how far `tokens` agrees
    /// with any cached key.
    fn walk(&self, tokens: &[u32]) -> (Option<usize>, usize) {
        let (mut node, mut pos) = (0usize, 0usize);
        let mut best = None;
        let shared = loop {
            if let Some(e) = self.node(node).entry {
                best = Some(e);
            }
            if pos == tokens.len() {
                break pos;
            }
            let Some(&child) = self.node(node).children.get(&tokens[pos]) else {
                break pos;
            };
            let edge = &self.node(child).edge;
            let m = common(edge, &tokens[pos..]);
            if m < edge.len() {
                break pos + m;
            }
            pos += m;
            node = child;
        };
        (best, shared)
    }

    /// The longest cached prefix of `tokens` (marked as just used) and how far `tokens`
    /// agrees with any cached key.
    pub fn lookup(&mut self, tokens: &[u32]) -> Lookup {
        let (best, shared) = self.walk(tokens);
        let hit = best.map(|e| {
            self.touch(e);
            let entry = self.entries[e].as_ref().expect("live entry");
            Hit {
                len: entry.len,
                state: entry.state.clone(),
                logits: entry.logits.clone(),
            }
        });
        Lookup { hit, shared }
    }

    /// [`PrefixCache::lookup`]'s lengths without taking anything or marking it used: the
    /// tokens of the longest cached prefix of `tokens` (0: none), and how far `tokens`
    /// agrees with any cached key. (Where a server of several replicas sends a prompt.)
    pub fn peek(&self, tokens: &[u32]) -> (usize, usize) {
        let (best, shared) = self.walk(tokens);
        let len = best.map_or(0, |e| self.entries[e].as_ref().expect("live entry").len);
        (len, shared)
    }

    /// What an entry for `key` with this state and logits costs.
    pub fn entry_bytes(key_len: usize, state: &State, logits_len: usize) -> usize {
        state.bytes() + 4 * logits_len + 4 * key_len + ENTRY_OVERHEAD
    }

    /// Store the state after `key` and the logits of its last token, evicting the least
    /// recently used entries to stay within the budget. Returns false when the entry alone
    /// is larger than the budget (nothing is stored then) or the key is empty.
    pub fn insert(&mut self, key: &[u32], state: State, logits: Arc<Vec<f32>>) -> bool {
        let bytes = Self::entry_bytes(key.len(), &state, logits.len());
        if key.is_empty() || bytes > self.budget {
            return false;
        }
        let target = self.node_for(key);
        if let Some(e) = self.node(target).entry {
            self.remove_entry(e, false);
        }
        while self.used + bytes > self.budget {
            let (&_, &victim) = self.lru.iter().next().expect("over budget with no entries");
            self.remove_entry(victim, true);
            self.evictions += 1;
        }
        // Eviction may have pruned nodes of the path: find (or rebuild) it again.
        let target = self.node_for(key);
        self.tick += 1;
        let entry = Entry {
            node: target,
            len: key.len(),
            state,
            logits,
            bytes,
            tick: self.tick,
        };
        let e = match self.free_entries.pop() {
            Some(i) => {
                self.entries[i] = Some(entry);
                i
            }
            None => {
                self.entries.push(Some(entry));
                self.entries.len() - 1
            }
        };
        self.lru.insert(self.tick, e);
        self.node_mut(target).entry = Some(e);
        self.used += bytes;
        true
    }

    fn new_node(&mut self, node: Node) -> usize {
        match self.free_nodes.pop() {
            Some(i) => {
                self.nodes[i] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    /// The node whose path spells `key`, creating and splitting edges as needed.
    fn node_for(&mut self, key: &[u32]) -> usize {
        let (mut node, mut pos) = (0usize, 0usize);
        while pos < key.len() {
            let first = key[pos];
            let Some(&child) = self.node(node).children.get(&first) else {
                let leaf = self.new_node(Node {
                    edge: key[pos..].to_vec(),
                    parent: node,
                    children: HashMap::new(),
                    entry: None,
                });
                self.node_mut(node).children.insert(first, leaf);
                return leaf;
            };
            let m = common(&self.node(child).edge, &key[pos..]);
            if m < self.node(child).edge.len() {
                // Split the edge at m: node -> mid -> child.
                let rest = self.node_mut(child).edge.split_off(m);
                let head = std::mem::replace(&mut self.node_mut(child).edge, rest);
                let mid = self.new_node(Node {
                    edge: head,
                    parent: node,
                    children: HashMap::new(),
                    entry: None,
                });
                let child_first = self.node(child).edge[0];
                self.node_mut(mid).children.insert(child_first, child);
                self.node_mut(child).parent = mid;
                self.node_mut(node).children.insert(first, mid);
                node = mid;
            } else {
                node = child;
            }
            pos += m;
        }
        node
    }

    fn remove_entry(&mut self, e: usize, prune: bool) {
        let entry = self.entries[e].take().expect("live entry");
        self.free_entries.push(e);
        self.lru.remove(&entry.tick);
        self.used -= entry.bytes;
        self.node_mut(entry.node).entry = None;
        if !prune {
            return;
        }
        // Drop nodes that no longer lead to any entry.
        let mut n = entry.node;
        while n != 0 {
            let node = self.node(n);
            if node.entry.is_some() || !node.children.is_empty() {
                break;
            }
            let (parent, first) = (node.parent, node.edge[0]);
            self.node_mut(parent).children.remove(&first);
            self.nodes[n] = None;
            self.free_nodes.push(n);
            n = parent;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Device, Model};
    use crate::mixers::mamba3::Weights;
    use crate::model::{Config, DType};

    fn model() -> Model {
        let cfg = Config::synthetic(32, 1, 16, 16, 2, 1, 64);
        Model::from_weights(Weights::synthetic(cfg, DType::F32, 1).unwrap(), Device::Cpu).unwrap()
    }

    #[test]
    fn longest_prefix_and_shared_length() {
        let m = model();
        let mut c = PrefixCache::new(1 << 30);
        let lg = Arc::new(vec![0.0; 64]);
        assert!(c.insert(&[1, 2, 3, 4], m.new_state(), lg.clone()));
        assert!(c.insert(&[1, 2], m.new_state(), lg.clone()));
        assert!(c.insert(&[1, 2, 3, 9, 9], m.new_state(), lg.clone()));
        let l = c.lookup(&[1, 2, 3, 4, 5]);
        assert_eq!(l.hit.map(|h| h.len), Some(4));
        assert_eq!(l.shared, 4);
        assert_eq!(c.peek(&[1, 2, 3, 7]), (2, 3));
        assert_eq!(c.peek(&[5]), (0, 0));
        let l = c.lookup(&[1, 2, 3, 7]);
        assert_eq!(l.hit.map(|h| h.len), Some(2));
        assert_eq!(l.shared, 3, "agrees with [1,2,3,4] and [1,2,3,9,9] up to 3");
        let l = c.lookup(&[5]);
        assert!(l.hit.is_none());
        assert_eq!(l.shared, 0);
        let l = c.lookup(&[1, 2, 3, 9, 9]);
        assert_eq!(l.hit.map(|h| h.len), Some(5));
        assert_eq!(c.stats().entries, 3);
    }

    #[test]
    fn budget_is_never_exceeded_and_lru_goes_first() {
        let m = model();
        let s = m.new_state();
        let lg = Arc::new(vec![0.0; 64]);
        let one = PrefixCache::entry_bytes(3, &s, 64);
        let mut c = PrefixCache::new(3 * one + 10);
        for i in 0..50u32 {
            assert!(c.insert(&[i, i + 1, i + 2], s.clone(), lg.clone()));
            assert!(c.stats().bytes <= c.stats().budget);
            if i == 10 {
                // Use entry 9 so that it outlives 10's older neighbours.
                assert!(c.lookup(&[9, 10, 11]).hit.is_some());
            }
        }
        assert_eq!(c.stats().entries, 3);
        assert!(c.lookup(&[49, 50, 51]).hit.is_some());
        assert!(c.lookup(&[0, 1, 2]).hit.is_none());
        assert_eq!(c.stats().evictions, 47);
        // An entry larger than the budget is refused.
        let mut small = PrefixCache::new(one - 1);
        assert!(!small.insert(&[1, 2, 3], s, lg));
        assert_eq!(small.stats().bytes, 0);
    }

    #[test]
    fn eviction_prunes_and_reinsert_works() {
        let m = model();
        let s = m.new_state();
        let lg = Arc::new(vec![0.0; 64]);
        let one = PrefixCache::entry_bytes(4, &s, 64);
        let mut c = PrefixCache::new(2 * one);
        let keys: Vec<Vec<u32>> = vec![vec![1, 2, 3, 4], vec![1, 2, 5, 6], vec![1, 7, 8, 9]];
        for k in &keys {
            c.insert(k, s.clone(), lg.clone());
        }
        assert!(c.lookup(&keys[0]).hit.is_none(), "oldest evicted");
        assert_eq!(c.lookup(&[1, 2, 5, 6, 0]).hit.map(|h| h.len), Some(4));
        assert_eq!(c.lookup(&[1, 7, 8, 9]).hit.map(|h| h.len), Some(4));
        c.insert(&keys[0], s.clone(), lg.clone());
        assert_eq!(c.lookup(&keys[0]).hit.map(|h| h.len), Some(4));
        assert_eq!(c.stats().entries, 2);
        // The same key again replaces its entry.
        c.insert(&keys[0], s, lg);
        assert_eq!(c.stats().entries, 2);
        assert!(c.stats().bytes <= 2 * one);
    }
}
