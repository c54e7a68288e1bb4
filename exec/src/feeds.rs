//! Deterministic seeded values: feeds for Placeholders when none are given, and the
//! initial values of Variables. Both depend only on the node name and the seed:
//! the same node name and seed give the same values in any graph.

use ampgraph_graph::ops::{Init, Variable};
use ampgraph_graph::{DType, Data, Tensor, TensorType};

use ampgraph_graph::rng::SplitMix64;

/// FNV-1a of the name, so the stream depends on the name and not on graph position.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Integer feeds are drawn from `0..INT_RANGE` (class labels of small problems).
pub const INT_RANGE: u64 = 10;

/// Values for a tensor named `name`: floats uniform in [-1, 1), integers in
/// [0, INT_RANGE), booleans fair coins. The caller has checked the size.
pub fn seeded_tensor(name: &str, ty: &TensorType, seed: u64) -> Tensor {
    let mut rng = SplitMix64::new(name_hash(name) ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
    let n = ty.checked_len().unwrap_or(0);
    let values = (0..n).map(|_| match ty.dtype {
        DType::I32 | DType::I64 => (rng.next_u64() % INT_RANGE) as f64,
        DType::Bool => (rng.next_u64() & 1) as f64,
        _ => rng.unit() * 2.0 - 1.0,
    });
    Tensor::new(ty.shape.clone(), Data::from_f64(ty.dtype, values)).expect("length matches shape")
}

/// Standard normal draws (Box-Muller).
fn normal(rng: &mut SplitMix64) -> f64 {
    let u1 = rng.unit().max(f64::MIN_POSITIVE);
    let u2 = rng.unit();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Fan-in and fan-out of a weight: [in, out] for dense, [h, w, in, out] for conv.
fn fans(shape: &[usize]) -> (f64, f64) {
    match shape {
        [] => (1.0, 1.0),
        [n] => (*n as f64, *n as f64),
        [.., fan_in, fan_out] => {
            let receptive: usize = shape[..shape.len() - 2].iter().product();
            ((receptive * fan_in) as f64, (receptive * fan_out) as f64)
        }
    }
}

/// The initial value of a Variable named `name`: deterministic in the name and seed.
pub fn initial_value(name: &str, var: &Variable, seed: u64) -> Tensor {
    let ty = &var.ty;
    let mut rng =
        SplitMix64::new(name_hash(name) ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED);
    let n = ty.checked_len().unwrap_or(0);
    let (fan_in, fan_out) = fans(&ty.shape);
    let init = match var.init {
        Init::Auto if ty.shape.len() >= 2 => Init::GlorotUniform,
        Init::Auto => Init::Zeros,
        other => other,
    };
    let values: Vec<f64> = match init {
        Init::Zeros | Init::Auto => vec![0.0; n],
        Init::Constant(v) => vec![v; n],
        Init::GlorotUniform | Init::HeUniform => {
            let limit = if init == Init::HeUniform {
                (6.0 / fan_in).sqrt()
            } else {
                (6.0 / (fan_in + fan_out)).sqrt()
            };
            (0..n).map(|_| (rng.unit() * 2.0 - 1.0) * limit).collect()
        }
        Init::GlorotNormal | Init::HeNormal => {
            let std = if init == Init::HeNormal {
                (2.0 / fan_in).sqrt()
            } else {
                (2.0 / (fan_in + fan_out)).sqrt()
            };
            (0..n).map(|_| normal(&mut rng) * std).collect()
        }
    };
    Tensor::new(ty.shape.clone(), Data::from_f64(ty.dtype, values)).expect("length matches shape")
}
