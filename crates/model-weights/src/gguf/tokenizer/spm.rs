//! SentencePiece's merge order as BPE merges, built in time linear in the
//! vocabulary's bytes.
//!
//! A merge is a split of a piece into two pieces of the vocabulary. Trying
//! every split by looking both halves up hashes the whole piece at every
//! position (quadratic in the piece's length), and storing every merge
//! takes the piece's bytes once per split: a vocabulary of nested runs
//! ("a", "aa", "aaa", ...) implies merges cubic in its size. So the halves
//! are tested with rolling hashes (constant time per split) and only the
//! candidates are checked exactly, and the merges' bytes are bounded by
//! [`MERGE_BYTES_PER_VOCAB_BYTE`] times the vocabulary's.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};

use serde_json::{Value, json};

/// The most bytes of merges (the merged pieces' lengths summed) per byte
/// of vocabulary. Real vocabularies need about 2 to 5 (Llama 2's 32,000
/// pieces have about 61,000 merges of a few bytes each); nested runs of
/// 31 characters, the longest Gemma has, about 21 on their own.
pub const MERGE_BYTES_PER_VOCAB_BYTE: u64 = 32;

/// 2^61 - 1: a prime, so a random base makes collisions unlikely whatever
/// the pieces (hashes modulo 2^64 collide on crafted strings).
const MODULUS: u64 = (1 << 61) - 1;

fn mul_mod(a: u64, b: u64) -> u64 {
    ((a as u128 * b as u128) % MODULUS as u128) as u64
}

/// Polynomial hashes of a string's prefixes, for any substring's in O(1).
struct Rolling {
    base: u64,
    /// `powers[i]` = base^i.
    powers: Vec<u64>,
    /// `prefix[i]` = hash of the first `i` bytes.
    prefix: Vec<u64>,
}

impl Rolling {
    fn new(max_len: usize) -> Self {
        // A base the input cannot know in advance.
        let base = 256 + RandomState::new().hash_one(0u8) % (MODULUS - 512);
        let mut powers = Vec::with_capacity(max_len + 1);
        powers.push(1);
        for i in 0..max_len {
            powers.push(mul_mod(powers[i], base));
        }
        Self {
            base,
            powers,
            prefix: Vec::with_capacity(max_len + 1),
        }
    }

    fn hash(&self, bytes: &[u8]) -> u64 {
        bytes.iter().fold(0, |h, &b| self.step(h, b))
    }

    /// Bytes count from 1 so that leading zero bytes change the hash.
    fn step(&self, h: u64, b: u8) -> u64 {
        (mul_mod(h, self.base) + u64::from(b) + 1) % MODULUS
    }

    fn load(&mut self, bytes: &[u8]) {
        self.prefix.clear();
        self.prefix.push(0);
        for &b in bytes {
            let h = self.step(*self.prefix.last().unwrap_or(&0), b);
            self.prefix.push(h);
        }
    }

    /// The hash of the loaded bytes `from..to`.
    fn range(&self, from: usize, to: usize) -> u64 {
        let shifted = mul_mod(self.prefix[from], self.powers[to - from]);
        (self.prefix[to] + MODULUS - shifted) % MODULUS
    }
}

/// Every split of every piece into two pieces of the vocabulary, ranked by
/// the merged piece's score (highest first), ties by the ids of the halves.
/// Past [`MERGE_BYTES_PER_VOCAB_BYTE`] times the vocabulary's bytes, an
/// error saying so.
pub(super) fn spm_merges(tokens: &[String], scores: &[f32]) -> Result<Vec<Value>, String> {
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .rev()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let vocab_bytes: u64 = tokens.iter().map(|t| t.len() as u64).sum();
    let limit = vocab_bytes.saturating_mul(MERGE_BYTES_PER_VOCAB_BYTE);
    let max_len = tokens.iter().map(String::len).max().unwrap_or(0);
    let mut rolling = Rolling::new(max_len);
    let hashes: HashSet<u64> = tokens.iter().map(|t| rolling.hash(t.as_bytes())).collect();
    let mut merges: Vec<(f32, usize, usize)> = Vec::new();
    let mut merge_bytes = 0u64;
    for (piece, &score) in tokens.iter().zip(scores) {
        rolling.load(piece.as_bytes());
        let n = piece.len();
        for (at, _) in piece.char_indices().skip(1) {
            if !hashes.contains(&rolling.range(0, at)) || !hashes.contains(&rolling.range(at, n)) {
                continue;
            }
            // A candidate: checked exactly (its cost, the piece's bytes,
            // is what the limit bounds).
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                merge_bytes += n as u64;
                if merge_bytes > limit {
                    return Err(format!(
                        "the SentencePiece merges this vocabulary implies (every split of \
                         every piece into two pieces) hold more than {limit} bytes, \
                         {MERGE_BYTES_PER_VOCAB_BYTE} times the vocabulary's {vocab_bytes} bytes"
                    ));
                }
                merges.push((score, li, ri));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    Ok(merges
        .into_iter()
        .map(|(_, l, r)| json!([tokens[l], tokens[r]]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn spm_merges_rank_by_the_merged_piece_score() {
        let tokens = owned(&["a", "b", "c", "ab", "bc", "abc"]);
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let merges = spm_merges(&tokens, &scores).unwrap();
        assert_eq!(
            merges,
            vec![
                json!(["b", "c"]),
                json!(["a", "b"]),
                json!(["a", "bc"]),
                json!(["ab", "c"])
            ]
        );
    }

    /// The rolling hashes find exactly the splits a lookup of both halves
    /// finds: multi-byte characters, NUL bytes, a piece listed twice.
    #[test]
    fn spm_merges_match_the_direct_lookup() {
        let tokens = owned(&[
            "▁", "t", "he", "▁t", "▁the", "the", "h", "e", "\0", "\0\0", "é", "éé", "▁t", "x\0",
            "x",
        ]);
        let scores: Vec<f32> = (0..tokens.len()).map(|i| -(i as f32)).collect();
        let direct: HashSet<(String, String)> = tokens
            .iter()
            .flat_map(|p| {
                p.char_indices()
                    .skip(1)
                    .map(|(at, _)| p.split_at(at))
                    .filter(|(l, r)| tokens.iter().any(|t| t == l) && tokens.iter().any(|t| t == r))
                    .map(|(l, r)| (l.to_string(), r.to_string()))
                    .collect::<Vec<_>>()
            })
            .collect();
        let merges = spm_merges(&tokens, &scores).unwrap();
        let found: HashSet<(String, String)> = merges
            .iter()
            .map(|m| (m[0].as_str().unwrap().into(), m[1].as_str().unwrap().into()))
            .collect();
        assert_eq!(found, direct);
        // "▁t" is listed twice: its merge appears once per listing.
        assert_eq!(merges.len(), 9, "{merges:?}");
    }

    #[test]
    fn merges_past_the_bound_are_refused() {
        let tokens: Vec<String> = (1..=200).map(|n| "a".repeat(n)).collect();
        let scores = vec![0.0; tokens.len()];
        let err = spm_merges(&tokens, &scores).unwrap_err();
        assert!(err.contains("more than 643200 bytes"), "{err}");
        assert!(err.contains("vocabulary's 20100 bytes"), "{err}");
    }
}
