//! Chains of Reshapes and Transposes as at most one Transpose (`compose-views`), and
//! a Transpose read only by Slices as the Slices' own Transposes, so that the chains
//! after them compose too.
//!
//! A Slice of a Reshape that splits or merges axes or adds or drops axes of one element
//! (a Squeeze), its window one range of each axis split and whole on each merged one,
//! reads the Reshape's input first, so that it meets the Transpose before.
//!
//! Why: `torch.onnx.export` writes `nn.MultiheadAttention` (sequence-first inside) as
//! a packed projection transposed whole (`[3, S, B, 1, E]`), sliced into q, k and v,
//! each reshaped to `[S, B H, D]`, transposed to `[B H, S, D]` and reshaped to `[B, H,
//! S, D]`, which `fuse-attention` transposes once more to the `[B, S, H, D]` it reads:
//! four copies of every operand where one suffices (ViT-B/16 at batch 32 spent 1.9 ms
//! of a 6 ms step in such Transposes and Slices).
//!
//! How: a chain's index map is followed on atoms, the factors of the first tensor's
//! axes that the chain never splits further: a Reshape regroups the current order of
//! atoms (splitting an atom where a new axis ends inside it), a Transpose permutes the
//! axes. The chain is then `Reshape(Transpose(Reshape(x, atoms), p), shape)` with the
//! Reshapes free (views), one copy where there were several. A Slice of a Transpose
//! is the Transpose of a Slice (`Slice(Transpose(x, p))` = `Transpose(Slice'(x), p)`,
//! the window's axes permuted back), taken where the Transpose's readers are all
//! Slices that together cover no more than it: no element moves twice more than
//! before.

use ampgraph_graph::ops::{Reshape, Slice, Transpose};
use ampgraph_graph::{Graph, NodeId, Op, Port};

use crate::rewrite::{dims, output_nodes, remove_unread, summary};
use crate::{Pass, PassError, PassSummary};

mod rows;

/// The `compose-views` pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct ComposeViews;

/// A tensor's axes as atoms: factors of the chain's first tensor's axes.
struct Atoms {
    /// Each atom's size (never 1: axes of one element have no atom).
    sizes: Vec<usize>,
    /// The atoms in the first tensor's row-major order.
    order: Vec<usize>,
    /// The current tensor's axes, each its atoms in row-major order.
    axes: Vec<Vec<usize>>,
}

impl Atoms {
    fn new(shape: &[usize]) -> Self {
        let mut atoms = Atoms {
            sizes: Vec::new(),
            order: Vec::new(),
            axes: Vec::new(),
        };
        for &n in shape {
            let mut axis = Vec::new();
            if n != 1 {
                axis.push(atoms.sizes.len());
                atoms.order.push(atoms.sizes.len());
                atoms.sizes.push(n);
            }
            atoms.axes.push(axis);
        }
        atoms
    }

    /// Splits `atom` into itself, `outer` long, and a new atom after it of the rest.
    fn split(&mut self, atom: usize, outer: usize) -> usize {
        let inner = self.sizes.len();
        self.sizes.push(self.sizes[atom] / outer);
        self.sizes[atom] = outer;
        let at = self.order.iter().position(|&a| a == atom).unwrap_or(0);
        self.order.insert(at + 1, inner);
        inner
    }

    /// Regroups the atoms, in the current order, into axes of `shape`; `None` where an
    /// axis would end inside an atom that does not divide there.
    fn reshape(&mut self, shape: &[usize]) -> Option<()> {
        let mut seq: Vec<usize> = self.axes.concat();
        let mut axes = Vec::with_capacity(shape.len());
        let mut k = 0;
        for &n in shape {
            let (mut axis, mut len) = (Vec::new(), 1usize);
            while len < n {
                let atom = *seq.get(k)?;
                let size = self.sizes[atom];
                if n % (len * size) == 0 {
                    len *= size;
                } else {
                    let outer = n / len;
                    if n % len != 0 || size % outer != 0 {
                        return None;
                    }
                    let inner = self.split(atom, outer);
                    seq.insert(k + 1, inner);
                    len *= outer;
                }
                axis.push(atom);
                k += 1;
            }
            if len != n {
                return None;
            }
            axes.push(axis);
        }
        (k == seq.len()).then_some(())?;
        self.axes = axes;
        Some(())
    }

    fn transpose(&mut self, perm: &[usize]) {
        self.axes = perm.iter().map(|&p| self.axes[p].clone()).collect();
    }

    /// The atoms' sizes in the first tensor's order, and the permutation of them that
    /// the current tensor's row-major order reads.
    fn plan(&self) -> (Vec<usize>, Vec<usize>) {
        let sizes = self.order.iter().map(|&a| self.sizes[a]).collect();
        let perm = (self.axes.concat().iter())
            .map(|a| self.order.iter().position(|o| o == a).unwrap_or(0))
            .collect();
        (sizes, perm)
    }
}

fn is_view_copy(g: &Graph, id: NodeId) -> bool {
    let op = &g.node(id).op;
    op.is::<Reshape>() || op.is::<Transpose>()
}

/// Whether `id` is a graph output's node (nodes made by the pass are not).
fn is_output(outputs: &[bool], id: NodeId) -> bool {
    outputs.get(id.index()).copied().unwrap_or(false)
}

/// The chain of Reshapes and Transposes ending at `end` (first to last), each but
/// `end` read only by the next and no graph output.
fn chain_to(g: &Graph, end: NodeId, outputs: &[bool]) -> Vec<NodeId> {
    let mut chain = vec![end];
    let mut at = end;
    loop {
        let x = g.inputs(at)[0];
        let sole = g.consumers(x.node).len() == 1 && !is_output(outputs, x.node);
        if !(is_view_copy(g, x.node) && sole) {
            break;
        }
        chain.push(x.node);
        at = x.node;
    }
    chain.reverse();
    chain
}

/// Composes the chain ending at `end` into one Transpose between Reshapes (none where
/// it moves nothing) where it holds two Transposes or more, or into one Reshape where
/// it holds Reshapes alone: the chain's nodes before `end`, now unread, if it did.
fn compose(g: &mut Graph, end: NodeId, outputs: &[bool]) -> Result<Option<Vec<NodeId>>, PassError> {
    let mut chain = chain_to(g, end, outputs);
    let transposes = chain
        .iter()
        .filter(|&&id| g.node(id).op.is::<Transpose>())
        .count();
    let x = g.inputs(chain[0])[0];
    let out = dims(&g.ty(Port::new(end, 0)).shape);
    if transposes == 0 && chain.len() > 1 {
        // Reshapes alone: one Reshape.
        g.set_node(end, Box::new(Reshape::new(out)), &[x])?;
        chain.pop();
        return Ok(Some(chain));
    }
    if transposes == 0 {
        return Ok(None);
    }
    let mut atoms = Atoms::new(&g.ty(x).shape);
    for &id in &chain {
        let op = &g.node(id).op;
        if let Some(t) = op.downcast_ref::<Transpose>() {
            atoms.transpose(&t.perm);
        } else if atoms.reshape(&g.ty(Port::new(id, 0)).shape).is_none() {
            return Ok(None);
        }
    }
    let (sizes, perm) = atoms.plan();
    // Atoms left in their order (a Transpose moving only axes of one element, as of a
    // `[1, C, 1, 1]` vector): a view, no copy at all.
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        chain.pop();
        g.set_node(end, Box::new(Reshape::new(out)), &[x])?;
        return Ok(Some(chain));
    }
    if transposes < 2 {
        return Ok(None);
    }
    chain.pop();
    let name = g.node(end).name.clone();
    let viewed = g.add_node(
        g.fresh_name(format!("{name}/atoms")),
        Box::new(Reshape::new(dims(&sizes))),
        &[x],
    )?;
    let moved = g.add_node(
        g.fresh_name(format!("{name}/composed")),
        Box::new(Transpose::new(perm)),
        &[viewed.into()],
    )?;
    g.set_node(end, Box::new(Reshape::new(out)), &[moved.into()])?;
    Ok(Some(chain))
}

/// Where Slice `s` reads a Reshape that splits or merges axes (or adds or drops axes of
/// one element), and the Slice's window is one contiguous range of each axis split and
/// the whole of each axis merged, the Slice of the Reshape's input, reshaped: the Slice
/// reads what the Reshape read (a packed projection's `[S, B, 3 E]` viewed as `[S, B,
/// 3, E]` and sliced at q, k or v is a range of its last axis).
fn slice_before_reshape(g: &mut Graph, s: NodeId) -> Result<bool, PassError> {
    let Some(slice) = g.node(s).op.downcast_ref::<Slice>().cloned() else {
        return Ok(false);
    };
    let r = g.inputs(s)[0];
    if !g.node(r.node).op.is::<Reshape>() {
        return Ok(false);
    }
    let y = g.inputs(r.node)[0];
    let (from, to) = (g.ty(y).shape.clone(), g.ty(r).shape.clone());
    let window = g.ty(Port::new(s, 0)).shape.clone();
    let begin_at = |i: usize| slice.begin.get(i).copied().unwrap_or(0);
    let (mut begin, mut size) = (vec![0usize; from.len()], vec![1i64; from.len()]);
    let kept =
        |shape: &[usize]| -> Vec<usize> { (0..shape.len()).filter(|&i| shape[i] != 1).collect() };
    let (fs, ts) = (kept(&from), kept(&to));
    // Groups of axes with equal products: one `from` axis split into `to` axes, or
    // `from` axes merged into one `to` axis.
    let (mut f, mut t) = (0, 0);
    while f < fs.len() && t < ts.len() {
        let (mut fp, mut tp) = (from[fs[f]], to[ts[t]]);
        let (f0, t0) = (f, t);
        while fp != tp {
            if fp < tp {
                f += 1;
                let Some(&a) = fs.get(f) else {
                    return Ok(false);
                };
                fp *= from[a];
            } else {
                t += 1;
                let Some(&a) = ts.get(t) else {
                    return Ok(false);
                };
                tp *= to[a];
            }
        }
        let (fg, tg) = (&fs[f0..=f], &ts[t0..=t]);
        match (fg, tg) {
            (&[a], group) => {
                // Contiguous in `a`: single elements, then one range, then whole axes.
                let Some(ranged) =
                    (0..group.len()).find(|&i| window[group[i]] != 1 || i + 1 == group.len())
                else {
                    return Ok(false);
                };
                if !group[ranged + 1..].iter().all(|&x| window[x] == to[x]) {
                    return Ok(false);
                }
                let (mut offset, mut stride) = (0, 1);
                for &x in group.iter().rev() {
                    offset += begin_at(x) * stride;
                    stride *= to[x];
                }
                let inner: usize = group[ranged + 1..].iter().map(|&x| to[x]).product();
                begin[a] = offset;
                size[a] = (window[group[ranged]] * inner) as i64;
            }
            (merged, &[x]) if window[x] == to[x] => {
                for &a in merged {
                    size[a] = from[a] as i64;
                }
            }
            _ => return Ok(false),
        }
        f += 1;
        t += 1;
    }
    if f < fs.len() || t < ts.len() {
        return Ok(false);
    }
    slice_first(
        g,
        s,
        y,
        Slice::new(begin, size),
        Box::new(Reshape::new(dims(&window))),
    )?;
    Ok(true)
}

/// Slice `s` becomes `then` of a new Slice `first` of `x` (named after `s`).
fn slice_first(
    g: &mut Graph,
    s: NodeId,
    x: Port,
    first: Slice,
    then: Box<dyn Op>,
) -> Result<(), PassError> {
    let name = g.fresh_name(format!("{}/first", g.node(s).name));
    let first = g.add_node(name, Box::new(first), &[x])?;
    g.set_node(s, then, &[first.into()])?;
    Ok(())
}

/// Moves the Slices reading Transpose `t` before it, where every reader is a Slice
/// and together they take no more elements than it has; whether it did.
fn slices_first(g: &mut Graph, t: NodeId, outputs: &[bool]) -> Result<bool, PassError> {
    let Some(perm) = g
        .node(t)
        .op
        .downcast_ref::<Transpose>()
        .map(|t| t.perm.clone())
    else {
        return Ok(false);
    };
    let readers: Vec<NodeId> = g.consumers(t).iter().map(|&(r, _, _)| r).collect();
    let all_slices = readers.iter().all(|&r| g.node(r).op.is::<Slice>());
    let taken: usize = readers
        .iter()
        .map(|&r| g.ty(Port::new(r, 0)).checked_len().unwrap_or(usize::MAX))
        .fold(0, usize::saturating_add);
    let within = g
        .ty(Port::new(t, 0))
        .checked_len()
        .is_some_and(|n| taken <= n);
    if readers.is_empty() || !all_slices || is_output(outputs, t) || !within {
        return Ok(false);
    }
    let x = g.inputs(t)[0];
    for r in readers {
        let Some(slice) = g.node(r).op.downcast_ref::<Slice>() else {
            continue;
        };
        let window = &g.ty(Port::new(r, 0)).shape;
        let (mut begin, mut size) = (vec![0; perm.len()], vec![0i64; perm.len()]);
        for (i, &p) in perm.iter().enumerate() {
            begin[p] = slice.begin.get(i).copied().unwrap_or(0);
            size[p] = window[i] as i64;
        }
        let then = Box::new(Transpose::new(perm.clone()));
        slice_first(g, r, x, Slice::new(begin, size), then)?;
    }
    Ok(true)
}

impl Pass for ComposeViews {
    fn name(&self) -> &'static str {
        "compose-views"
    }

    fn run(&self, g: &mut Graph) -> Result<PassSummary, PassError> {
        // Chains composed first: a row view may end one.
        let mut counts = compose_all(g)?;
        let moves = rows::move_past_row_ops(g)?;
        if moves > 0 {
            let again = compose_all(g)?;
            counts = std::array::from_fn(|k| counts[k] + again[k]);
        }
        let [moved, composed, removed] = counts;
        let lines = vec![
            format!(
                "compose-views: {moved} Transposes moved after the Slices reading them, {composed} chains of Reshapes and Transposes as one Transpose or Reshape ({removed} nodes fewer)"
            ),
            format!(
                "compose-views: {moves} times a row reordering moved after a row-wise op reading it"
            ),
        ];
        Ok(summary("compose-views", lines))
    }
}

/// The pass but for the row views, in rounds until one changes nothing (a chain
/// composed into a Transpose that Slices read can move after them in the next): how
/// many Transposes moved after Slices, chains composed and nodes removed.
fn compose_all(g: &mut Graph) -> Result<[usize; 3], PassError> {
    let mut total = [0; 3];
    loop {
        let counts = compose_round(g)?;
        total = std::array::from_fn(|k| total[k] + counts[k]);
        if counts[2] == 0 {
            return Ok(total);
        }
    }
}

/// One round of [`compose_all`]: how many Transposes moved after Slices, chains
/// composed and nodes removed.
fn compose_round(g: &mut Graph) -> Result<[usize; 3], PassError> {
    // Which nodes are graph outputs, by index, found again as nodes are added.
    let mut outputs = output_nodes(g);
    let mut stale = Vec::new();
    let slices: Vec<NodeId> = (g.node_ids())
        .filter(|&id| g.node(id).op.is::<Slice>())
        .collect();
    for s in slices {
        let r = g.inputs(s)[0].node;
        if slice_before_reshape(g, s)? {
            stale.push(r);
        }
    }
    let (mut removed, _) = remove_unread(g, std::mem::take(&mut stale), &outputs)?;
    outputs = output_nodes(g);
    let mut moved = 0;
    let transposes: Vec<NodeId> = (g.node_ids())
        .filter(|&id| g.node(id).op.is::<Transpose>())
        .collect();
    for t in transposes {
        if slices_first(g, t, &outputs)? {
            moved += 1;
            stale.push(t);
        }
    }
    removed += remove_unread(g, std::mem::take(&mut stale), &outputs)?.0;
    outputs = output_nodes(g);
    // Chains end where a view's readers are not one view of the chain.
    let ends: Vec<NodeId> = (g.node_ids())
        .filter(|&id| is_view_copy(g, id))
        .filter(|&id| {
            let readers = g.consumers(id);
            is_output(&outputs, id) || !matches!(readers[..], [(r, _, _)] if is_view_copy(g, r))
        })
        .collect();
    let mut composed = 0;
    for end in ends {
        if let Some(interior) = compose(g, end, &outputs)? {
            composed += 1;
            stale.extend(interior);
        }
    }
    outputs = output_nodes(g);
    removed += remove_unread(g, stale, &outputs)?.0;
    Ok([moved, composed, removed])
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::amp::{AmpConfig, AutoMixedPrecision, Fp8Config, Fp8Recipe};
    use crate::testing::{assert_same_bits, count, run, sine};
    use ampgraph_graph::{DType, Tensor};

    /// `torch.onnx.export`'s `nn.MultiheadAttention` operands: a packed projection
    /// `[S, B, 3 E]` transposed whole, sliced into q, k and v, each reshaped,
    /// transposed to `[B H, S, D]`, reshaped to `[B, H, S, D]` and transposed to the
    /// `[B, S, H, D]` that fuse-attention's FusedAttention reads.
    #[test]
    fn attention_operands_are_one_slice_and_one_transpose_each() {
        let (s, b, h, d) = (5usize, 2usize, 2usize, 3usize);
        let e = h * d;
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [s, b, 3 * e]).unwrap();
        let r = g.reshape(x, [s as i64, b as i64, 3, e as i64]).unwrap();
        let r = g.reshape(r, [1, s as i64, b as i64, 3, e as i64]).unwrap();
        let t = g.transpose(r, [3, 1, 2, 0, 4]).unwrap();
        let packed = g.reshape(t, [3, s as i64, b as i64, e as i64]).unwrap();
        let mut outs = Vec::new();
        for which in 0..3 {
            let part = g
                .add(
                    Slice::new([which, 0, 0, 0], [1, s as i64, b as i64, e as i64]),
                    &[packed],
                )
                .unwrap();
            let v = g.reshape(part, [s as i64, b as i64, e as i64]).unwrap();
            let v = g.reshape(v, [s as i64, (b * h) as i64, d as i64]).unwrap();
            let v = g.transpose(v, [1, 0, 2]).unwrap();
            let v = g
                .reshape(v, [b as i64, h as i64, s as i64, d as i64])
                .unwrap();
            outs.push(g.transpose(v, [0, 2, 1, 3]).unwrap());
        }
        g.set_outputs(outs).unwrap();
        let feeds: HashMap<&str, Tensor> = [("x", sine(&[s, b, 3 * e], 0.37))].into();
        let before = run(&g, &feeds);
        assert_eq!(count(&g, "Transpose"), 7);
        let summary = ComposeViews.run(&mut g).unwrap();
        assert!(
            summary.lines[0].contains("1 Transposes moved after the Slices reading them, 4 chains"),
            "{}",
            summary.lines[0]
        );
        g.validate().unwrap();
        assert_eq!((count(&g, "Transpose"), count(&g, "Slice")), (3, 3));
        assert_same_bits(&before, &run(&g, &feeds));
        // A second run finds nothing.
        let again = ComposeViews.run(&mut g).unwrap();
        assert!(
            again.lines[0].contains(" 0 Transposes moved"),
            "{}",
            again.lines[0]
        );
        assert!(again.lines[0].contains(" 0 chains"), "{}", again.lines[0]);
    }

    /// torchvision's ViT attention as `torch.onnx.export` writes `nn.MultiheadAttention`
    /// (`batch_first`): the input transposed to sequence-first, the packed projection,
    /// q, k and v cut and transposed to `[B, S, H, D]`; the attention's result
    /// transposed back through the out-projection. After the pass no Transpose is left:
    /// q, k and v are Slices of the projection, and the out-projection reads the
    /// attention's rows as they are; the same bits. With both projections in FP8 (AMP
    /// with every product FP8, current scaling: the rows are read by their cast and by
    /// their amax's scale) as many Transposes and Slices are left as with BF16 AMP
    /// (whose casts back to f32 at this graph's outputs keep some).
    #[test]
    fn an_exported_multi_head_attention_needs_no_transpose() {
        assert_eq!(exported_multi_head_attention_copies(None), (0, 3));
        let bf16 = AmpConfig::new(DType::BF16).unwrap();
        let fp8 = bf16
            .clone()
            .with_fp8(Fp8Config::everywhere(Fp8Recipe::Current));
        assert_eq!(
            exported_multi_head_attention_copies(Some(fp8)),
            exported_multi_head_attention_copies(Some(bf16))
        );
    }

    /// The Transposes and Slices left by the pass, after AMP where given.
    fn exported_multi_head_attention_copies(amp: Option<AmpConfig>) -> (usize, usize) {
        let (s, b, h, d) = (5usize, 2usize, 2usize, 3usize);
        let e = h * d;
        let i = |v: usize| v as i64;
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [b, s, e]).unwrap();
        let w_in = g.placeholder("w_in", DType::F32, [e, 3 * e]).unwrap();
        let b_in = g.placeholder("b_in", DType::F32, [3 * e]).unwrap();
        let o = g.placeholder("o", DType::F32, [b, s, h, d]).unwrap();
        let w_out = g.placeholder("w_out", DType::F32, [e, e]).unwrap();
        let b_out = g.placeholder("b_out", DType::F32, [e]).unwrap();
        let t = g.transpose(x, [1, 0, 2]).unwrap();
        let rows = g.reshape(t, [-1, i(e)]).unwrap();
        let y = g.matmul(rows, w_in).unwrap();
        let y = g.plus(y, b_in).unwrap();
        let y = g.reshape(y, [i(s), i(b), i(3 * e)]).unwrap();
        let y = g.reshape(y, [i(s), i(b), 3, i(e)]).unwrap();
        let y = g.reshape(y, [1, i(s), i(b), 3, i(e)]).unwrap();
        let y = g.transpose(y, [3, 1, 2, 0, 4]).unwrap();
        let packed = g.reshape(y, [3, i(s), i(b), i(e)]).unwrap();
        let mut outs = Vec::new();
        for which in 0..3 {
            let v = g
                .add(Slice::new([which, 0, 0, 0], [1, -1, -1, -1]), &[packed])
                .unwrap();
            let v = g.reshape(v, [i(s), i(b * h), i(d)]).unwrap();
            let v = g.transpose(v, [1, 0, 2]).unwrap();
            let v = g.reshape(v, [i(b), i(h), i(s), i(d)]).unwrap();
            outs.push(g.transpose(v, [0, 2, 1, 3]).unwrap());
        }
        let a = g.transpose(o, [0, 2, 1, 3]).unwrap();
        let a = g.transpose(a, [2, 0, 1, 3]).unwrap();
        let a = g.reshape(a, [i(s * b), i(e)]).unwrap();
        let a = g.matmul(a, w_out).unwrap();
        let a = g.plus(a, b_out).unwrap();
        let a = g.reshape(a, [i(s), i(b), i(e)]).unwrap();
        outs.push(g.transpose(a, [1, 0, 2]).unwrap());
        g.set_outputs(outs).unwrap();
        let feeds: HashMap<&str, Tensor> = [
            ("x", sine(&[b, s, e], 0.37)),
            ("w_in", sine(&[e, 3 * e], 0.53)),
            ("b_in", sine(&[3 * e], 0.71)),
            ("o", sine(&[b, s, h, d], 0.29)),
            ("w_out", sine(&[e, e], 0.61)),
            ("b_out", sine(&[e], 0.83)),
        ]
        .into();
        let fp8 = amp.as_ref().is_some_and(|c| c.fp8.is_some());
        if let Some(config) = amp {
            AutoMixedPrecision::new(config).rewrite(&mut g).unwrap();
        }
        assert_eq!(count(&g, "Fp8MatMul"), if fp8 { 2 } else { 0 });
        let before = run(&g, &feeds);
        ComposeViews.run(&mut g).unwrap();
        g.validate().unwrap();
        assert_same_bits(&before, &run(&g, &feeds));
        (count(&g, "Transpose"), count(&g, "Slice"))
    }

    /// Slices that overlap (together more than the Transpose holds) stay after it: moved,
    /// they would copy more than the Transpose does.
    #[test]
    fn overlapping_slices_keep_their_transpose() {
        let mut g = Graph::new();
        let x = g.placeholder("x", DType::F32, [4, 6]).unwrap();
        let t = g.transpose(x, [1, 0]).unwrap();
        let a = g.add(Slice::new([0, 0], [5, 4]), &[t]).unwrap();
        let b = g.add(Slice::new([1, 0], [5, 4]), &[t]).unwrap();
        g.set_outputs(vec![a, b]).unwrap();
        let summary = ComposeViews.run(&mut g).unwrap();
        assert!(
            summary.lines[0].contains(" 0 Transposes moved"),
            "{}",
            summary.lines[0]
        );
        assert_eq!(count(&g, "Transpose"), 1);
    }

    /// A per-channel vector reshaped to `[1, C, 1, 1]` and transposed to NHWC's `[1, 1,
    /// 1, C]` (a synchronised batch norm's gradient terms after `layout-nhwc`) keeps its
    /// values in their order: one Reshape, a view, where a Transpose copied them.
    #[test]
    fn a_transpose_moving_only_unit_axes_is_a_view() {
        let mut g = Graph::new();
        let v = g.placeholder("v", DType::F32, [5]).unwrap();
        let r = g.reshape(v, [1, 5, 1, 1]).unwrap();
        let t = g.transpose(r, [0, 2, 3, 1]).unwrap();
        let lone = g.placeholder("lone", DType::F32, [1, 5, 1, 1]).unwrap();
        let u = g.transpose(lone, [0, 2, 3, 1]).unwrap();
        g.set_outputs(vec![t, u]).unwrap();
        let before = g.clone();
        ComposeViews.run(&mut g).unwrap();
        assert_eq!(count(&g, "Transpose"), 0);
        let feeds = HashMap::from([("v", sine(&[5], 1.0)), ("lone", sine(&[1, 5, 1, 1], 2.0))]);
        assert_same_bits(&run(&before, &feeds), &run(&g, &feeds));
    }

    /// Random chains of Reshapes and Transposes over a `[2, 3, 4]` tensor (reshapes
    /// to random factorisations of 24, random permutations): the same values, and no
    /// more Transposes than before.
    #[test]
    fn random_chains_keep_their_values() {
        let shapes: [&[usize]; 9] = [
            &[2, 3, 4],
            &[6, 4],
            &[4, 6],
            &[2, 12],
            &[24],
            &[2, 2, 2, 3],
            &[3, 2, 4],
            &[1, 6, 1, 4],
            &[2, 3, 2, 2],
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let mut composed = 0;
        for case in 0..300 {
            let mut g = Graph::new();
            let x = g.placeholder("x", DType::F32, [2, 3, 4]).unwrap();
            let mut y = x;
            for _ in 0..2 + next(5) {
                let rank = g.ty(y).rank();
                if next(2) == 0 {
                    let mut perm: Vec<usize> = (0..rank).collect();
                    for i in (1..rank).rev() {
                        perm.swap(i, next(i + 1));
                    }
                    y = g.transpose(y, perm).unwrap();
                } else {
                    let shape: Vec<i64> = shapes[next(shapes.len())]
                        .iter()
                        .map(|&d| d as i64)
                        .collect();
                    y = g.reshape(y, shape).unwrap();
                }
            }
            g.set_outputs(vec![y]).unwrap();
            let feeds: HashMap<&str, Tensor> = [("x", sine(&[2, 3, 4], 0.37))].into();
            let before = run(&g, &feeds);
            let transposes = count(&g, "Transpose");
            let line = ComposeViews.run(&mut g).unwrap().lines[0].clone();
            composed += usize::from(!line.contains(" 0 chains"));
            g.validate().unwrap();
            assert!(count(&g, "Transpose") <= transposes.max(1), "case {case}");
            assert_same_bits(&before, &run(&g, &feeds));
        }
        assert!(composed > 50, "only {composed} of 300 chains composed");
    }
}
