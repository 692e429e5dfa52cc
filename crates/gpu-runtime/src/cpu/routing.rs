//! MoE routers on the host: sigmoid scores with a correction bias and expert
//! groups (DeepSeek-V3, arXiv:2412.19437 §2.1.2; Nemotron-H's MoE layers).

use crate::ops::moe::GroupedTopK;

/// The routes of every row of `logits` (`[rows, n]`), as
/// [`MoeOps::sigmoid_topk`](crate::ops::MoeOps::sigmoid_topk) specifies:
/// `rows * k` (expert, weight) pairs; an error text for an impossible shape.
pub(super) fn sigmoid_topk(
    logits: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    p: &GroupedTopK,
) -> Result<Vec<(u32, f32)>, String> {
    let groups = p.n_group;
    if groups == 0 || !n.is_multiple_of(groups) {
        return Err(format!("{n} experts do not split into {groups} groups"));
    }
    let per_group = n / groups;
    if p.topk_group == 0 || p.topk_group > groups {
        return Err(format!("top-{} of {groups} groups", p.topk_group));
    }
    if p.k == 0 || p.k > p.topk_group * per_group {
        return Err(format!(
            "top-{} of the {} experts in {} groups",
            p.k,
            p.topk_group * per_group,
            p.topk_group
        ));
    }
    let rows = logits.len() / n.max(1);
    let mut out = Vec::with_capacity(rows * p.k);
    let (mut scores, mut choice) = (vec![0f32; n], vec![0f32; n]);
    let mut group_scores: Vec<(f32, usize)> = Vec::with_capacity(groups);
    let mut order: Vec<u32> = Vec::with_capacity(n);
    for row in logits.chunks_exact(n) {
        for (i, &x) in row.iter().enumerate() {
            scores[i] = 1.0 / (1.0 + (-x).exp());
            choice[i] = scores[i] + bias.map_or(0.0, |b| b[i]);
        }
        // Each group scores the sum of its best two choice scores (its best
        // one when it has a single expert).
        group_scores.clear();
        for (g, members) in choice.chunks_exact(per_group).enumerate() {
            let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &c in members {
                if c > first {
                    (first, second) = (c, first);
                } else if c > second {
                    second = c;
                }
            }
            let score = if per_group == 1 {
                first
            } else {
                first + second
            };
            group_scores.push((score, g));
        }
        group_scores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let kept = &group_scores[..p.topk_group];
        order.clear();
        order.extend((0..n as u32).filter(|&e| {
            let g = e as usize / per_group;
            kept.iter().any(|&(_, k)| k == g)
        }));
        order.sort_by(|&a, &b| {
            choice[b as usize]
                .total_cmp(&choice[a as usize])
                .then(a.cmp(&b))
        });
        let top = &order[..p.k];
        let denom = if p.renormalize {
            top.iter().map(|&e| scores[e as usize]).sum::<f32>() + p.renorm_eps
        } else {
            1.0
        };
        out.extend(
            top.iter()
                .map(|&e| (e, scores[e as usize] / denom * p.scale)),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(k: usize, n_group: usize, topk_group: usize) -> GroupedTopK {
        GroupedTopK {
            k,
            n_group,
            topk_group,
            renormalize: true,
            renorm_eps: 1e-20,
            scale: 2.5,
        }
    }

    #[test]
    fn the_bias_chooses_and_the_scores_weigh() {
        // Without the bias expert 0 and 1 win; the bias makes 3 win instead
        // of 1, but 3's weight is its sigmoid score, not score + bias.
        let logits = [2.0f32, 1.0, -1.0, 0.0];
        let bias = [0.0f32, 0.0, 0.0, 2.0];
        let got = sigmoid_topk(&logits, Some(&bias), 4, &params(2, 1, 1)).unwrap();
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        let sum = s(2.0) + s(0.0);
        assert_eq!(got[0].0, 3);
        assert_eq!(got[1].0, 0);
        assert!((got[0].1 - s(0.0) / sum * 2.5).abs() < 1e-6);
        assert!((got[1].1 - s(2.0) / sum * 2.5).abs() < 1e-6);
    }

    #[test]
    fn only_the_best_groups_are_chosen_from() {
        // Groups {0,1}, {2,3}, {4,5}: group scores 1.1, 1.6, 1.2 (sum of the
        // two best); with one group kept, both experts come from {2,3}
        // although expert 0 alone scores highest.
        let logits: Vec<f32> = [0.95f32, 0.15, 0.8, 0.8, 0.6, 0.6]
            .iter()
            .map(|p| (p / (1.0 - p)).ln())
            .collect();
        let got = sigmoid_topk(&logits, None, 6, &params(2, 3, 1)).unwrap();
        let mut experts: Vec<u32> = got.iter().map(|r| r.0).collect();
        experts.sort();
        assert_eq!(experts, vec![2, 3]);
        // Two groups kept: {2,3} and {4,5}; the best two of those.
        let got = sigmoid_topk(&logits, None, 6, &params(3, 3, 2)).unwrap();
        assert_eq!(got.iter().map(|r| r.0).collect::<Vec<_>>(), vec![2, 3, 4]);
    }

    #[test]
    fn impossible_shapes_are_errors() {
        let logits = [0f32; 6];
        assert!(sigmoid_topk(&logits, None, 6, &params(2, 4, 1)).is_err());
        assert!(sigmoid_topk(&logits, None, 6, &params(3, 3, 1)).is_err());
        assert!(sigmoid_topk(&logits, None, 6, &params(1, 3, 4)).is_err());
        assert!(sigmoid_topk(&logits, None, 6, &params(0, 3, 1)).is_err());
    }
}
