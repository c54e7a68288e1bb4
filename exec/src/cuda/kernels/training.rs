//! The training step's own ops: the all-finite check of the gradients, the dynamic
//! loss scale's update and counter, and the optimizer updates (one variable, or a
//! group of them in one launch).

use ampgraph_graph::ops::{
    AllFinite, Anneal, GroupedOptimizerUpdate, IncrementIf, LearningRateSchedule, LossScaleUpdate,
    OptimizerUpdate, Rule,
};
use ampgraph_graph::{DType, Op, TensorType};

use super::codegen::{
    elementwise, elementwise_in, lit, module, module_multi, own, store, At, Load, Store, MAX_RANK,
    PRELUDE,
};
use super::{
    acc_dtype, first, float_only, input, kernel, launch_grouped, one_output, Ctx, KernelResult,
    Lowering,
};
use crate::cuda::device::{update_table_declaration, Arg, DTensor, Dims};

kernel_specs! {
    /// The modules of the family.
    #[derive(Clone, Debug, PartialEq)]
    enum Spec in "training" {
        /// `k(u8* flag, int v)`: `flag[0] = v`.
        FillFlag {} => fill_flag(),
        /// `k(Dims ptrs0, Dims lens0, int count0, ..., u8* flag[, const TS* ps])`: a list of
        /// up to [`MAX_RANK`] tensors per entry of `lists` (their dtypes).
        AllFinite { lists: Vec<DType>, scale: Option<DType> } => all_finite(&lists, scale),
        /// `k(const u8* flag, const T* counter, T* y)`
        IncrementIf { dtype: DType } => increment_if(dtype),
        /// `k(const u8* flag, const T* scale, const TG* good, T* scale_out, TG* good_out)`
        LossScaleUpdate { scale: DType, good_steps: DType, growth_interval: i64, growth_factor: f64, backoff_factor: f64 } => loss_scale_update(scale, good_steps, growth_interval, growth_factor, backoff_factor),
        /// `k` (and `k_group`, `k_apply` for LAMB): see [`optimizer`].
        Optimizer { var: DType, grad: DType, grad_scale: bool, grad_rounded_to: Option<DType>, step: Option<DType>, cast_to: Option<DType>, rule: Rule, learning_rate: f64, scheduled: bool, weight_decay: f64 } => optimizer(var, GradRead { dtype: grad, scaled: grad_scale, rounded_to: grad_rounded_to }, step, cast_to, rule, learning_rate, scheduled, weight_decay),
        /// `k(const T* count, float* factor)`: one thread.
        Schedule { count: DType, schedule: LearningRateSchedule } => schedule_factor(count, schedule),
    }
}

pub(super) fn lower(op: &dyn Op, ins: &[TensorType], outs: &[TensorType]) -> Lowering {
    if let Some(a) = op.downcast_ref::<AllFinite>() {
        return Some(lower_all_finite(a.scaled, ins, outs));
    }
    if op.is::<IncrementIf>() {
        return Some(lower_increment_if(ins, outs));
    }
    if let Some(l) = op.downcast_ref::<LossScaleUpdate>() {
        return Some(lower_loss_scale_update(l, ins, outs));
    }
    if let Some(u) = op.downcast_ref::<OptimizerUpdate>() {
        return Some(lower_optimizer(u, ins, outs));
    }
    if let Some(g) = op.downcast_ref::<GroupedOptimizerUpdate>() {
        return Some(lower_grouped_optimizer(g, ins, outs));
    }
    if let Some(s) = op.downcast_ref::<LearningRateSchedule>() {
        return Some(lower_schedule(*s, ins, outs));
    }
    None
}

/// One launch for all, in lists of one dtype and at most [`MAX_RANK`] tensors: ten
/// gradients' checks launched one by one cost more than reading them.
fn lower_all_finite(scaled: bool, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let (checked, scale) = match ins.split_last() {
        Some((s, xs)) if scaled => (xs, Some(s.dtype)),
        _ => (ins, None),
    };
    // Each dtype's inputs by index, dtypes in order of first appearance.
    let mut by_dtype: Vec<(DType, Vec<usize>)> = Vec::new();
    for (k, x) in checked.iter().enumerate() {
        float_only(x.dtype)?;
        match by_dtype.iter_mut().find(|(d, _)| *d == x.dtype) {
            Some((_, xs)) => xs.push(k),
            None => by_dtype.push((x.dtype, vec![k])),
        }
    }
    let lists: Vec<(DType, Vec<usize>)> = by_dtype
        .iter()
        .flat_map(|(d, xs)| xs.chunks(MAX_RANK).map(|list| (*d, list.to_vec())))
        .collect();
    let spec = Spec::AllFinite {
        lists: lists.iter().map(|(d, _)| *d).collect(),
        scale,
    };
    let out = first(outs)?;
    let n_checked = checked.len();
    Ok(one_output(out, move |c, inputs, flag| {
        c.launch(&Spec::FillFlag {}, "k", (1, 1), &[flag.arg(), Arg::I32(1)])?;
        if lists.is_empty() {
            return Ok(());
        }
        let mut args = Vec::new();
        for (_, list) in &lists {
            let ptrs: Vec<usize> = list.iter().map(|&k| inputs[k].ptr() as usize).collect();
            let lens: Vec<usize> = list.iter().map(|&k| inputs[k].len()).collect();
            args.extend([
                Arg::Dims(Dims::new(&ptrs)?),
                Arg::Dims(Dims::new(&lens)?),
                Arg::I32(list.len() as i32),
            ]);
        }
        args.push(flag.arg());
        if scale.is_some() {
            args.push(input(inputs, n_checked)?.arg());
        }
        let most = inputs[..n_checked].iter().map(DTensor::len).max();
        c.launch_elementwise(&spec, most.unwrap_or(0), &args)?;
        Ok(())
    }))
}

fn lower_schedule(
    schedule: LearningRateSchedule,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let spec = Spec::Schedule {
        count: first(ins)?.dtype,
        schedule,
    };
    Ok(one_output(first(outs)?, move |c, inputs, y| {
        c.launch(&spec, "k", (1, 1), &[input(inputs, 0)?.arg(), y.arg()])?;
        Ok(())
    }))
}

fn lower_increment_if(ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let spec = Spec::IncrementIf {
        dtype: ins
            .get(1)
            .ok_or("IncrementIf takes a flag and a counter")?
            .dtype,
    };
    let out = first(outs)?;
    Ok(one_output(out, move |c, inputs, y| {
        let (f, counter) = (input(inputs, 0)?, input(inputs, 1)?);
        c.launch(&spec, "k", (1, 1), &[f.arg(), counter.arg(), y.arg()])?;
        Ok(())
    }))
}

fn lower_loss_scale_update(
    l: &LossScaleUpdate,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let [_, s, g, ..] = ins else {
        return Err("LossScaleUpdate takes a flag, the scale and its counter".into());
    };
    let spec = Spec::LossScaleUpdate {
        scale: s.dtype,
        good_steps: g.dtype,
        growth_interval: l.growth_interval,
        growth_factor: l.growth_factor,
        backoff_factor: l.backoff_factor,
    };
    if outs.len() < 2 {
        return Err("missing output 1".into());
    }
    let outs = outs.to_vec();
    Ok(kernel(move |c, inputs| {
        let (f, s, g) = (input(inputs, 0)?, input(inputs, 1)?, input(inputs, 2)?);
        let s_out = c.alloc(&outs[0])?;
        let g_out = c.alloc(&outs[1])?;
        c.launch(
            &spec,
            "k",
            (1, 1),
            &[f.arg(), s.arg(), g.arg(), s_out.arg(), g_out.arg()],
        )?;
        Ok(vec![s_out, g_out])
    }))
}

/// An update's module for its operands' dtypes (`inputs` in an update's order: flag,
/// var, grad, [grad scale], slots..., [step]), checked.
fn update_spec(u: &OptimizerUpdate, inputs: &[TensorType]) -> Result<Spec, String> {
    let n_slots = u.rule.slots().len();
    if inputs.len() != u.num_inputs() {
        return Err(format!("expected {} inputs", u.num_inputs()));
    }
    let (var, grad) = (inputs[1].dtype, inputs[2].dtype);
    float_only(var)?;
    float_only(grad)?;
    if let Some(s) = inputs[3..3 + n_slots].iter().find(|s| s.dtype != var) {
        return Err(format!(
            "slots must have the variable's dtype {var} on CUDA, got {}",
            s.dtype
        ));
    }
    Ok(Spec::Optimizer {
        var,
        grad,
        grad_scale: u.grad_scale,
        grad_rounded_to: u.grad_rounded_to,
        step: u.rule.uses_step().then(|| inputs[3 + n_slots].dtype),
        cast_to: u.cast_to,
        rule: u.rule,
        learning_rate: u.learning_rate,
        scheduled: u.scheduled,
        weight_decay: u.weight_decay,
    })
}

/// The arguments an update's kernels take before their outputs: flag, var, grad,
/// [grad scale], slots..., [step], [rate factor] (`inputs` in the update's order).
fn update_args(u: &OptimizerUpdate, inputs: &[DTensor]) -> Vec<Arg> {
    let n_slots = u.rule.slots().len();
    let mut args = vec![inputs[0].arg(), inputs[1].arg(), inputs[2].arg()];
    if u.grad_scale {
        args.push(inputs[inputs.len() - 1].arg());
    }
    args.extend(inputs[3..3 + n_slots].iter().map(DTensor::arg));
    if u.rule.uses_step() {
        args.push(inputs[3 + n_slots].arg());
    }
    if let Some(k) = u.factor_input() {
        args.push(inputs[k].arg());
    }
    args
}

fn lower_optimizer(u: &OptimizerUpdate, ins: &[TensorType], outs: &[TensorType]) -> KernelResult {
    let spec = update_spec(u, ins)?;
    if outs.len() != u.num_outputs() {
        return Err(format!("expected {} outputs", u.num_outputs()));
    }
    let (u, outs) = (u.clone(), outs.to_vec());
    Ok(kernel(move |c, inputs| {
        if inputs.len() != u.num_inputs() {
            return Err(format!("expected {} inputs", u.num_inputs()));
        }
        let outputs = c.alloc_all(&outs)?;
        let var = &inputs[1];
        let n = var.len();
        let mut args = update_args(&u, inputs);
        if let Rule::Lamb { .. } = u.rule {
            lamb(c, &spec, &u, inputs, &outputs, args)?;
            return Ok(outputs);
        }
        args.extend(outputs.iter().map(DTensor::arg));
        args.push(Arg::I64(n as i64));
        c.launch_elementwise(&spec, n, &args)?;
        Ok(outputs)
    }))
}

/// LAMB's two launches: `k` computes the update and its norms' sums (writing the
/// slots), `k_apply` scales it by the trust ratio into the variable (and its cast).
fn lamb(
    c: &Ctx,
    spec: &Spec,
    u: &OptimizerUpdate,
    inputs: &[DTensor],
    outputs: &[DTensor],
    mut args: Vec<Arg>,
) -> Result<(), String> {
    let (flag, var) = (&inputs[0], &inputs[1]);
    let (n, n_slots) = (var.len(), u.rule.slots().len());
    let acc = acc_dtype(var.dtype);
    let scratch = c.temp(acc, n)?;
    let sums = c.temp(acc, 2)?;
    c.dev.zero(&sums)?;
    args.extend(outputs[1..1 + n_slots].iter().map(DTensor::arg));
    args.extend([scratch.arg(), sums.arg(), Arg::I64(n as i64)]);
    let grid = n.div_ceil(256).clamp(1, 1024) as u32;
    c.launch(spec, "k", (grid, 256), &args)?;
    // The variable's outputs: itself, then its cast if any (the slots came above).
    let mut apply = vec![flag.arg(), var.arg()];
    if let Some(k) = u.factor_input() {
        apply.push(inputs[k].arg());
    }
    apply.extend([scratch.arg(), sums.arg()]);
    apply.extend(
        std::iter::once(&outputs[0])
            .chain(&outputs[1 + n_slots..])
            .map(DTensor::arg),
    );
    apply.push(Arg::I64(n as i64));
    let grid = n.div_ceil(256).clamp(1, 1 << 20) as u32;
    c.launch(spec, "k_apply", (grid, 256), &apply)
}

/// A GroupedOptimizerUpdate: [`GROUP_MEMBERS`](crate::cuda::device::GROUP_MEMBERS) members a launch of `k_group`, a block
/// each, their pointers in a by-value table. Every member has the first's dtypes (the
/// `group-updates` pass groups only such updates).
fn lower_grouped_optimizer(
    g: &GroupedOptimizerUpdate,
    ins: &[TensorType],
    outs: &[TensorType],
) -> KernelResult {
    let u = g.update.clone();
    if let Rule::Lamb { .. } = u.rule {
        return Err("LAMB updates are not grouped: each needs its own variable's norms".into());
    }
    let (n_in, n_out) = (u.num_inputs(), u.num_outputs());
    if ins.len() != g.members * n_in || outs.len() != g.members * n_out {
        return Err(format!(
            "expected {} inputs and {} outputs",
            g.members * n_in,
            g.members * n_out
        ));
    }
    let dtypes = |m: &[TensorType]| m.iter().map(|t| t.dtype).collect::<Vec<_>>();
    let specs = ins
        .chunks(n_in)
        .map(|member| update_spec(&u, member))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(spec) = specs.first().cloned() else {
        let outs = outs.to_vec();
        return Ok(kernel(move |c, _| c.alloc_all(&outs)));
    };
    if let Some(k) = ins
        .chunks(n_in)
        .position(|m| dtypes(m) != dtypes(&ins[..n_in]))
    {
        return Err(format!("member {k}'s dtypes differ from member 0's"));
    }
    let outs = outs.to_vec();
    Ok(kernel(move |c, inputs| {
        let outputs = c.alloc_all(&outs)?;
        let members: Vec<(Vec<Arg>, usize)> = (inputs.chunks(n_in).zip(outputs.chunks(n_out)))
            .map(|(member, outs)| {
                let mut args = update_args(&u, member);
                args.extend(outs.iter().map(DTensor::arg));
                (args, member[1].len())
            })
            .collect();
        launch_grouped(c, &spec, "k_group", 256, &members)?;
        Ok(outputs)
    }))
}

/// Sets `flag[0] = v`.
pub(super) fn fill_flag() -> String {
    format!("{PRELUDE}extern \"C\" __global__ void k(u8* flag, int v) {{ flag[0] = (u8)v; }}\n")
}

/// AllFinite in one launch: `lists` are the dtypes of lists of up to [`MAX_RANK`]
/// tensors each (list `q`: their addresses and lengths in `ptrs<q>` and `lens<q>`,
/// `count<q>` of them), checked one after another by the whole grid. Clears `flag` at
/// a value that is not finite (times the scale `ps`, in its dtype, when folded
/// unscaling gave one). One launch for all dtypes: the mlp's f32 bias gradients in a
/// launch of their own ran on two blocks for 7.5 us.
pub(super) fn all_finite(lists: &[DType], scale: Option<DType>) -> String {
    let suffixes: Vec<String> = (0..lists.len()).map(|q| format!("L{q}")).collect();
    let mut types: Vec<(&str, DType)> = suffixes
        .iter()
        .map(String::as_str)
        .zip(lists.iter().copied())
        .collect();
    types.push(("S", scale.or(lists.first().copied()).unwrap_or(DType::F32)));
    let mut params: Vec<String> = (0..lists.len())
        .map(|q| format!("Dims ptrs{q}, Dims lens{q}, int count{q}"))
        .collect();
    params.push("u8* flag".into());
    if scale.is_some() {
        params.push("const TS* ps".into());
    }
    let mut body = String::new();
    for (q, (suffix, d)) in suffixes.iter().zip(lists).enumerate() {
        let (ty, loader) = (format!("C{suffix}"), format!("ld{suffix}"));
        let check = match scale {
            Some(_) => "m_mul_rn((CS)x, ldS(ps, 0))".to_string(),
            None => format!("(A{suffix})x"),
        };
        let x = Load {
            ty: &ty,
            name: "x",
            loader: &loader,
            ptr: "px",
            bytes: d.size_bytes(),
            at: At::Own,
        };
        // Unrolled over the list's limit: the Dims indexed by a variable would be
        // copied into local memory by every thread.
        body.push_str(&format!(
            "#pragma unroll\n\
             for (int t = 0; t < {MAX_RANK}; ++t) {{\n\
               if (t >= count{q}) break;\n\
               const T{suffix}* px = (const T{suffix}*)ptrs{q}.n[t]; const i64 n = lens{q}.n[t];\n{}}}\n",
            elementwise(&[x], &format!("if (!m_isfinite({check})) flag[0] = 0;"), &[])
        ));
    }
    module_multi(
        &types,
        &format!(
            "extern \"C\" __global__ void k({}) {{\n{body}}}\n",
            params.join(", ")
        ),
    )
}

pub(super) fn increment_if(d: DType) -> String {
    module(
        d,
        "extern \"C\" __global__ void k(const u8* f, const T* pc, T* py) {\n\
           C v = ld(pc, 0); if (f[0]) v = v + (C)1; st(py, 0, v);\n}\n",
    )
}

/// [`LearningRateSchedule::factor`] in double, rounded once to f32.
pub(super) fn schedule_factor(count: DType, s: LearningRateSchedule) -> String {
    let annealed = match s.anneal {
        Anneal::Cosine => "0.5 * (1.0 + cos(3.141592653589793 * p))",
        Anneal::Linear => "1.0 - p",
    };
    module(
        count,
        &format!(
            "extern \"C\" __global__ void k(const T* pc, float* py) {{\n\
               const double s = fmax((double)ld(pc, 0) - 1.0, 0.0), warmup = {warmup}, total = {total}, last = {last};\n\
               double y;\n\
               if (s < warmup) y = (s + 1.0) / warmup;\n\
               else if (s >= total) y = last;\n\
               else {{ const double p = (s - warmup) / (total - warmup); y = last + (1.0 - last) * ({annealed}); }}\n\
               py[0] = (float)y;\n}}\n",
            warmup = lit(s.warmup as f64),
            total = lit(s.total as f64),
            last = lit(s.final_ratio),
        ),
    )
}

pub(super) fn loss_scale_update(
    scale: DType,
    good: DType,
    interval: i64,
    growth: f64,
    backoff: f64,
) -> String {
    module_multi(
        &[("S", scale), ("G", good)],
        &format!(
            "extern \"C\" __global__ void k(const u8* f, const TS* ps, const TG* pg, TS* ps_out, TG* pg_out) {{\n\
               double s = (double)ldS(ps, 0), n = (double)ldG(pg, 0);\n\
               if (f[0]) {{ if (n + 1.0 >= (double){interval}) {{ s = s * {growth}; n = 0.0; }} else {{ n = n + 1.0; }} }}\n\
               else {{ s = fmax(s * {backoff}, 1.0); n = 0.0; }}\n\
               stS(ps_out, 0, (CS)s); stG(pg_out, 0, (CG)n);\n}}\n",
            growth = lit(growth),
            backoff = lit(backoff)
        ),
    )
}

/// How an update reads its gradient: of `dtype`, rounded to `rounded_to` where set
/// (`OptimizerUpdate::grad_rounded_to`), then times the gradient scale where `scaled`.
#[derive(Clone, Copy)]
pub(super) struct GradRead {
    pub dtype: DType,
    pub scaled: bool,
    pub rounded_to: Option<DType>,
}

impl GradRead {
    /// The code making the gradient `C g` of `C g_in` as loaded, `scale` the
    /// expression of the gradient scale where `scaled`.
    fn code(self, scale: &str) -> String {
        let read = match self.rounded_to {
            Some(_) => "TN g_t[1]; stN(g_t, 0, (CN)g_in); const C g_read = (C)ldN(g_t, 0);",
            None => "const C g_read = g_in;",
        };
        match self.scaled {
            true => format!("{read} C g = m_mul_rn(g_read, {scale});"),
            false => format!("{read} C g = g_read;"),
        }
    }
}

/// OptimizerUpdate. Arguments: flag, var, grad, [grad scale], slots..., [step], out
/// var, out slots..., [cast out], [lamb scratch, lamb sums], n. Skipped steps copy
/// the inputs. The gradient is read as `grad` says (rounded, then multiplied by the
/// gradient scale, a scalar of the variable's dtype, where asked); with `cast_to` the
/// kernel that writes the variable also writes its cast (of the stored value, as a
/// Cast kernel would). SGD and Adam
/// modules also have `k_group`, a GroupedOptimizerUpdate's kernel: block `m` updates
/// member `m`, whose arguments but `n` are row `m` of an `UpdateTable`.
#[allow(clippy::too_many_arguments)]
pub(super) fn optimizer(
    var: DType,
    grad: GradRead,
    step: Option<DType>,
    cast_to: Option<DType>,
    rule: Rule,
    lr: f64,
    scheduled: bool,
    wd: f64,
) -> String {
    let mut types = vec![("", var), ("G", grad.dtype)];
    if let Some(n) = grad.rounded_to {
        types.push(("N", n));
    }
    if let Some(s) = step {
        types.push(("S", s));
    }
    if let Some(k) = cast_to {
        types.push(("K", k));
    }
    if scheduled {
        types.push(("R", DType::F32));
    }
    // The rate in double, as the CPU's: the peak times the schedule's factor.
    let (rate_param, lr) = match scheduled {
        true => (
            "const TR* plr, ",
            format!("const double lr = {} * (double)ldR(plr, 0);\n", lit(lr)),
        ),
        false => ("", format!("const double lr = {};\n", lit(lr))),
    };
    let wd = lit(wd);
    // LAMB's update needs the norms of the whole update: two grid loops of its own.
    let Rule::Lamb {
        beta1,
        beta2,
        epsilon,
    } = rule
    else {
        return module_multi(
            &types,
            &elementwise_update(var, grad, cast_to, rule, (rate_param, &lr), &wd),
        );
    };
    let (cp, cs) = match cast_to {
        Some(_) => (", TK* pk_out", " stK(pk_out, i, (CK)ld(pw_out, i));"),
        None => ("", ""),
    };
    let grad_in = match grad.scaled {
        true => "const TG* pg, const T* pgs",
        false => "const TG* pg",
    };
    let head = format!(
        "C w = ld(pw, i); const C g_in = (C)ldG(pg, i); {}",
        grad.code("ld(pgs, 0)")
    );
    let body = format!(
            "extern \"C\" __global__ void k(const u8* f, const T* pw, {grad_in}, const T* pm, const T* pv, const TS* ps, {rate_param}T* pm_out, T* pv_out, A* scratch, A* sums, i64 n) {{\n\
               double t = (double)ldS(ps, 0);\n\
               C c1 = (C)(1.0 - pow({b1}, t)), c2 = (C)(1.0 - pow({b2}, t));\n\
               C b1 = (C){b1}, b2 = (C){b2}, eps = (C){eps};\n\
               __shared__ A sh[32];\n\
               A ws = 0, us = 0;\n\
               GRID_LOOP(i, n) {{\n\
                 if (!f[0]) {{ pm_out[i] = pm[i]; pv_out[i] = pv[i]; continue; }}\n\
                 {head}\n\
                 C m = b1 * ld(pm, i) + ((C)1 - b1) * g;\n\
                 C v = b2 * ld(pv, i) + ((C)1 - b2) * g * g;\n\
                 C u = (m / c1) / (m_sqrt(v / c2) + eps) + (C){wd} * w;\n\
                 st(pm_out, i, m); st(pv_out, i, v); scratch[i] = (A)u;\n\
                 ws += (A)w * (A)w; us += (A)u * (A)u;\n\
               }}\n\
               ws = block_sum(ws, sh); us = block_sum(us, sh);\n\
               if (threadIdx.x == 0) {{ atomicAdd(&sums[0], ws); atomicAdd(&sums[1], us); }}\n}}\n\
             extern \"C\" __global__ void k_apply(const u8* f, const T* pw, {rate_param}const A* scratch, const A* sums, T* pw_out{cp}, i64 n) {{\n\
               {lr}\
               A wn = m_sqrt(sums[0]), un = m_sqrt(sums[1]);\n\
               A trust = (wn > (A)0 && un > (A)0) ? wn / un : (A)1;\n\
               GRID_LOOP(i, n) {{\n\
                 if (!f[0]) {{ pw_out[i] = pw[i];{cs} continue; }}\n\
                 st(pw_out, i, (C)((A)ld(pw, i) - (A)lr * trust * scratch[i]));{cs}\n\
               }}\n}}\n",
            b1 = lit(beta1),
            b2 = lit(beta2),
            eps = lit(epsilon),
        );
    module_multi(&types, &body)
}

/// The kernel of an SGD or Adam update on the vectorised [`elementwise`] loop (one
/// element per thread and a 4-byte load at a time kept the updates under 2.8 TB/s).
/// A skipped step (flag 0) writes the inputs back.
fn elementwise_update(
    var: DType,
    grad: GradRead,
    cast_to: Option<DType>,
    rule: Rule,
    (rate_param, lr_setup): (&str, &str),
    wd: &str,
) -> String {
    let lr = "lr";
    let own_grad = Load {
        ty: "C",
        name: "g_in",
        loader: "ldG",
        ptr: "pg",
        bytes: grad.dtype.size_bytes(),
        at: At::Own,
    };
    let mut loads = vec![own(var, "w", "pw"), own_grad];
    let mut stores = vec![store(var, "pw_out", "w_new")];
    // Per rule: the slot (and step) parameters, the outputs, code before the loop and
    // the loop's body, which sets w_new (and the slots' new values) where `ok`.
    let (slots, outs, setup, body) = match rule {
        Rule::Sgd { momentum, nesterov } if momentum != 0.0 => {
            loads.push(own(var, "b", "pb"));
            stores.push(store(var, "pb_out", "b_new"));
            let mo = lit(momentum);
            let step = if nesterov {
                format!("g + (C){mo} * b_new")
            } else {
                "b_new".into()
            };
            (
                "const T* pb, ",
                "T* pw_out, T* pb_out",
                String::new(),
                format!(
                    "C b_new = b;\n\
                     if (ok) {{ g = g + (C){wd} * w; b_new = (C){mo} * b + g; w_new = w - (C){lr} * ({step}); }}"
                ),
            )
        }
        Rule::Sgd { .. } => (
            "",
            "T* pw_out",
            String::new(),
            format!("if (ok) w_new = w - (C){lr} * (g + (C){wd} * w);"),
        ),
        Rule::Adam {
            beta1,
            beta2,
            epsilon,
            decoupled,
        } => {
            loads.push(own(var, "m", "pm"));
            loads.push(own(var, "v", "pv"));
            stores.push(store(var, "pm_out", "m_new"));
            stores.push(store(var, "pv_out", "v_new"));
            let (b1, b2, eps) = (lit(beta1), lit(beta2), lit(epsilon));
            let (coupled, decay) = if decoupled {
                (String::new(), format!("(C){wd} * w"))
            } else {
                (format!("g = g + (C){wd} * w;"), "(C)0".into())
            };
            (
                "const T* pm, const T* pv, const TS* ps, ",
                "T* pw_out, T* pm_out, T* pv_out",
                format!(
                    "const double t = (double)ldS(ps, 0);\n\
                     const C c1 = (C)(1.0 - pow({b1}, t)), c2 = (C)(1.0 - pow({b2}, t));\n"
                ),
                format!(
                    "C m_new = m, v_new = v;\n\
                     if (ok) {{\n\
                       {coupled}\n\
                       m_new = (C){b1} * m + ((C)1 - (C){b1}) * g;\n\
                       v_new = (C){b2} * v + ((C)1 - (C){b2}) * g * g;\n\
                       C update = (m_new / c1) / (m_sqrt(v_new / c2) + (C){eps});\n\
                       w_new = w - (C){lr} * (update + {decay});\n\
                     }}"
                ),
            )
        }
        Rule::Lamb { .. } => unreachable!("LAMB needs the norms of the whole update"),
    };
    // The cast is of the value as stored (rounded to the variable's type).
    let (cast_out, kept) = match cast_to {
        Some(k) => {
            stores.push(Store {
                storer: "stK",
                ptr: "pk_out",
                bytes: k.size_bytes(),
                value: "(CK)w_kept",
            });
            (
                ", TK* pk_out",
                "T w_t[1]; st(w_t, 0, w_new); const C w_kept = ld(w_t, 0);",
            )
        }
        None => ("", ""),
    };
    let (scale, gs) = match grad.scaled {
        true => ("const T* pgs, ", "const C gs = ld(pgs, 0);\n"),
        false => ("", ""),
    };
    let params = format!(
        "const u8* f, const T* pw, const TG* pg, {scale}{slots}{rate_param}{outs}{cast_out}"
    );
    // The parameters' names, and each as k_group reads it from its table row.
    let declared: Vec<(&str, &str)> = params
        .split(',')
        .filter_map(|p| p.trim().rsplit_once(' '))
        .collect();
    let names: Vec<&str> = declared.iter().map(|(_, name)| *name).collect();
    let from_table: Vec<String> = declared
        .iter()
        .enumerate()
        .map(|(k, (ty, _))| format!("({ty})t.p[m][{k}]"))
        .collect();
    format!(
        "__device__ __forceinline__ void update({params}, i64 n, i64 block, i64 blocks) {{\n\
           const bool ok = f[0] != 0;\n\
           {lr_setup}{gs}{setup}{loop}}}\n\
         extern \"C\" __global__ void k({params}, i64 n) {{ update({names}, n, blockIdx.x, gridDim.x); }}\n\
         {table}\
         // A grouped update: block m updates member m (its pointers in row m).\n\
         extern \"C\" __global__ void k_group(const UpdateTable t) {{\n\
           const int m = blockIdx.x;\n\
           update({from_table}, t.n[m], 0, 1);\n}}\n",
        loop = elementwise_in(
            &loads,
            &format!("{} C w_new = w;\n{body}\n{kept}", grad.code("gs")),
            &stores,
            ("block", "blocks"),
        ),
        names = names.join(", "),
        table = update_table_declaration(),
        from_table = from_table.join(", "),
    )
}
