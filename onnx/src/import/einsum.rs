//! ONNX Einsum as the ops a contraction is made of (as XLA and onnxruntime lower it):
//! per operand, a sum over the labels nothing else reads; per pair of operands, a
//! Transpose of each into `[batch, kept, contracted]` and `[batch, contracted, kept]`,
//! a batched product and a Reshape; a Transpose into the output's order last. More than
//! two operands contract left to right. Diagonals (a label twice in one operand) are
//! refused.

use std::collections::HashMap;

use ampgraph_graph::ops::{
    BatchMatMul, BroadcastTo, MatMul, Reduce, ReduceKind, Reshape, Transpose,
};

use super::{NodeCx, Value};
use crate::error::Result;

/// An equation's labels: one per axis of each operand, and of the output.
#[derive(Debug, PartialEq)]
pub(super) struct Equation {
    pub inputs: Vec<Vec<char>>,
    pub output: Vec<char>,
}

/// Labels standing for the axes an ellipsis covers (an equation's own labels are
/// ASCII letters).
fn ellipsis_label(k: usize) -> char {
    char::from_u32(0x3b1 + k as u32).unwrap_or('?')
}

impl Equation {
    /// `equation` for operands of `ranks`; an ellipsis covers the axes an operand has
    /// beyond its letters (aligned from the right, as NumPy broadcasts them), and an
    /// equation without `->` outputs its ellipsis axes, then the letters used once, in
    /// alphabetical order.
    pub fn parse(equation: &str, ranks: &[usize]) -> std::result::Result<Equation, String> {
        let text: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
        let (lhs, rhs) = match text.split_once("->") {
            Some((l, r)) => (l, Some(r)),
            None => (text.as_str(), None),
        };
        let terms: Vec<&str> = lhs.split(',').collect();
        if terms.len() != ranks.len() {
            return Err(format!(
                "equation '{equation}' has {} operands but the node has {}",
                terms.len(),
                ranks.len()
            ));
        }
        let letters = |term: &str| -> std::result::Result<(Vec<char>, bool), String> {
            let dotted = term.contains("...");
            let rest = term.replacen("...", "", 1);
            match rest.chars().find(|c| !c.is_ascii_alphabetic()) {
                Some(c) => Err(format!("equation '{equation}': '{c}' is not a label")),
                None => Ok((rest.chars().collect(), dotted)),
            }
        };
        let mut spans = Vec::new();
        for (term, &rank) in terms.iter().zip(ranks) {
            let (named, dotted) = letters(term)?;
            let span = rank.checked_sub(named.len()).filter(|&s| dotted || s == 0);
            match span {
                Some(s) => spans.push(s),
                None => {
                    return Err(format!(
                    "equation '{equation}': term '{term}' does not fit an operand of rank {rank}"
                ))
                }
            }
        }
        let widest = spans.iter().copied().max().unwrap_or(0);
        let expand = |term: &str, span: usize| -> std::result::Result<Vec<char>, String> {
            let (before, after) = term.split_once("...").unwrap_or((term, ""));
            let mut labels: Vec<char> = letters(before)?.0;
            labels.extend((widest - span..widest).map(ellipsis_label));
            labels.extend(letters(after)?.0);
            Ok(labels)
        };
        let inputs = (terms.iter().zip(&spans))
            .map(|(t, &s)| expand(t, s))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        for (term, labels) in terms.iter().zip(&inputs) {
            if let Some(c) = labels
                .iter()
                .find(|c| labels.iter().filter(|d| d == c).count() > 1)
            {
                return Err(format!(
                    "equation '{equation}': '{c}' twice in '{term}' takes a diagonal, which is not supported"
                ));
            }
        }
        let output = match rhs {
            Some(r) => expand(r, widest)?,
            None => {
                let all: Vec<char> = inputs.iter().flatten().copied().collect();
                let mut once: Vec<char> = (all.iter().copied())
                    .filter(|c| {
                        c.is_ascii_alphabetic() && all.iter().filter(|d| *d == c).count() == 1
                    })
                    .collect();
                once.sort_unstable();
                (0..widest).map(ellipsis_label).chain(once).collect()
            }
        };
        for (k, c) in output.iter().enumerate() {
            if output[..k].contains(c) || !inputs.iter().any(|l| l.contains(c)) {
                return Err(format!(
                    "equation '{equation}': output label '{c}' is repeated or in no operand"
                ));
            }
        }
        Ok(Equation { inputs, output })
    }
}

/// An operand on its way through the contraction: its value and its axes' labels.
struct Operand {
    value: Value,
    labels: Vec<char>,
}

/// The ONNX Einsum node of `cx`.
pub(super) fn einsum(cx: &mut NodeCx) -> Result<Vec<Value>> {
    let equation = cx.string_attr("equation", "")?;
    let values = cx.inputs()?;
    let ranks: Vec<usize> = values.iter().map(|v| cx.ty(v).shape.len()).collect();
    let eq = Equation::parse(&equation, &ranks).map_err(|m| cx.err(m))?;
    // Each label's size; an ellipsis axis of 1 broadcasts.
    let mut sizes: HashMap<char, usize> = HashMap::new();
    for (v, labels) in values.iter().zip(&eq.inputs) {
        for (&c, &n) in labels.iter().zip(&cx.ty(v).shape) {
            let size = sizes.entry(c).or_insert(n);
            if *size != n && n != 1 && *size != 1 {
                return Err(cx.err(format!(
                    "label '{c}' is {size} in one operand and {n} in another"
                )));
            }
            *size = (*size).max(n);
        }
    }
    let mut operands = (values.into_iter().zip(eq.inputs.clone()))
        .map(|(value, labels)| Operand { value, labels });
    let Some(mut acc) = operands.next() else {
        return Err(cx.err("takes at least one operand"));
    };
    let rest: Vec<Operand> = operands.collect();
    for (k, next) in rest.into_iter().enumerate() {
        // Labels later operands or the output still read.
        let later: Vec<char> = (eq.output.iter().copied())
            .chain(labels_after(&eq, k + 2))
            .collect();
        acc = contract(cx, acc, next, &later, &sizes)?;
    }
    acc = sum_unread(cx, acc, &eq.output, &[])?;
    let perm: Vec<usize> = (eq.output.iter())
        .map(|c| acc.labels.iter().position(|d| d == c).unwrap_or(0))
        .collect();
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok(vec![acc.value]);
    }
    cx.out(Transpose::new(perm), &[acc.value])
}

/// The labels of operands `from..`.
fn labels_after(eq: &Equation, from: usize) -> Vec<char> {
    eq.inputs.iter().skip(from).flatten().copied().collect()
}

/// `x` summed over the labels neither `keep` nor `other` has.
fn sum_unread(cx: &mut NodeCx, x: Operand, keep: &[char], other: &[char]) -> Result<Operand> {
    let unread: Vec<i64> = (x.labels.iter().enumerate())
        .filter(|(_, c)| !keep.contains(c) && !other.contains(c))
        .map(|(i, _)| i as i64)
        .collect();
    if unread.is_empty() {
        return Ok(x);
    }
    let value = cx.emit(
        Reduce::new(ReduceKind::Sum, Some(unread.clone()), false),
        &[x.value],
    )?;
    let labels = (x.labels.iter().enumerate())
        .filter(|(i, _)| !unread.contains(&(*i as i64)))
        .map(|(_, &c)| c)
        .collect();
    Ok(Operand { value, labels })
}

/// `x` transposed to the labels `order` (a permutation of its own), broadcast to each
/// label's size, and reshaped into the products of the groups `dims` (consecutive
/// counts of `order`).
fn arranged(
    cx: &mut NodeCx,
    x: Operand,
    order: &[char],
    dims: &[usize],
    sizes: &HashMap<char, usize>,
) -> Result<Value> {
    let perm: Vec<usize> = (order.iter())
        .map(|c| x.labels.iter().position(|d| d == c).unwrap_or(0))
        .collect();
    let mut value = x.value;
    if perm.iter().enumerate().any(|(i, &p)| i != p) {
        value = cx.emit(Transpose::new(perm), &[value])?;
    }
    let full: Vec<usize> = order.iter().map(|c| sizes[c]).collect();
    if cx.ty(&value).shape != full {
        value = cx.emit(BroadcastTo::new(full.clone()), &[value])?;
    }
    let mut grouped = Vec::new();
    let mut at = 0;
    for &n in dims {
        grouped.push(full[at..at + n].iter().product::<usize>() as i64);
        at += n;
    }
    cx.emit(Reshape::new(grouped), &[value])
}

/// `a` times `b`, keeping the labels of `later` (and neither operand's own-only labels
/// unless `later` reads them): one MatMul or BatchMatMul.
fn contract(
    cx: &mut NodeCx,
    a: Operand,
    b: Operand,
    later: &[char],
    sizes: &HashMap<char, usize>,
) -> Result<Operand> {
    let a = sum_unread(cx, a, later, &b.labels)?;
    let b = sum_unread(cx, b, later, &a.labels)?;
    let shared = |c: &&char| b.labels.contains(c);
    let batch: Vec<char> = (a.labels.iter())
        .filter(shared)
        .filter(|c| later.contains(c))
        .copied()
        .collect();
    let summed: Vec<char> = (a.labels.iter())
        .filter(shared)
        .filter(|c| !later.contains(c))
        .copied()
        .collect();
    let a_only: Vec<char> = (a.labels.iter())
        .filter(|c| !b.labels.contains(c))
        .copied()
        .collect();
    let b_only: Vec<char> = (b.labels.iter())
        .filter(|c| !a.labels.contains(c))
        .copied()
        .collect();
    let cat = |parts: &[&[char]]| parts.concat();
    let product = if batch.is_empty() {
        let x = arranged(
            cx,
            a,
            &cat(&[&a_only, &summed]),
            &[a_only.len(), summed.len()],
            sizes,
        )?;
        let y = arranged(
            cx,
            b,
            &cat(&[&summed, &b_only]),
            &[summed.len(), b_only.len()],
            sizes,
        )?;
        cx.emit(MatMul::new(false, false), &[x, y])?
    } else {
        let a_dims = [batch.len(), a_only.len(), summed.len()];
        let x = arranged(cx, a, &cat(&[&batch, &a_only, &summed]), &a_dims, sizes)?;
        let b_dims = [batch.len(), summed.len(), b_only.len()];
        let y = arranged(cx, b, &cat(&[&batch, &summed, &b_only]), &b_dims, sizes)?;
        cx.emit(BatchMatMul::new(false, false), &[x, y])?
    };
    let labels = cat(&[&batch, &a_only, &b_only]);
    let shape: Vec<i64> = labels.iter().map(|c| sizes[c] as i64).collect();
    let value = cx.emit(Reshape::new(shape), &[product])?;
    Ok(Operand { value, labels })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(s: &str) -> Vec<char> {
        s.chars().collect()
    }

    #[test]
    fn equations_parse_with_ellipses_and_implicit_outputs() {
        let eq = Equation::parse("bhid, bhjd -> bhij", &[4, 4]).unwrap();
        assert_eq!(eq.inputs, vec![labels("bhid"), labels("bhjd")]);
        assert_eq!(eq.output, labels("bhij"));
        // Implicit: the letters used once, sorted.
        let eq = Equation::parse("ij,jk", &[2, 2]).unwrap();
        assert_eq!(eq.output, labels("ik"));
        // An ellipsis of two axes and one of none, aligned from the right.
        let eq = Equation::parse("...ij,...jk->...ik", &[4, 2]).unwrap();
        let (e0, e1) = (ellipsis_label(0), ellipsis_label(1));
        assert_eq!(eq.inputs[0], vec![e0, e1, 'i', 'j']);
        assert_eq!(eq.inputs[1], labels("jk"));
        assert_eq!(eq.output, vec![e0, e1, 'i', 'k']);
    }

    #[test]
    fn bad_equations_are_errors_naming_the_problem() {
        let err = |s: &str, ranks: &[usize]| Equation::parse(s, ranks).unwrap_err();
        assert!(err("ii->i", &[2]).contains("diagonal"));
        assert!(err("ij,jk->ik", &[2]).contains("2 operands"));
        assert!(err("ijk->ik", &[2]).contains("rank 2"));
        assert!(err("ij->iz", &[2]).contains("'z'"));
        assert!(err("i1->i", &[2]).contains("'1' is not a label"));
    }
}
