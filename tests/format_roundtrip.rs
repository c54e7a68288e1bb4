//! Property tests of the file formats: random valid graphs survive
//! JSON -> GraphDef -> Graph -> bin -> Graph -> JSON unchanged, and decoding mutated or
//! truncated binary files never panics.

use ampgraph::graph::attrs::{AttrMap, AttrValue};
use ampgraph::graph::format::{self, GraphDef, NodeDef};
use ampgraph::graph::{DType, Graph};
use proptest::prelude::*;

/// A tiny deterministic generator; proptest supplies the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        ampgraph::graph::rng::step(&mut self.0)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// A float that JSON writes and reads back exactly and f32 stores exactly.
    fn float(&mut self) -> f64 {
        let v = (self.below(2001) as f64 - 1000.0) / 64.0;
        if self.below(10) == 0 {
            *self.pick(&[
                0.1f32 as f64,
                1e-30f32 as f64,
                -3.5e30f32 as f64,
                -0.0,
                1e10,
            ])
        } else {
            v
        }
    }
}

/// A tensor the generator can feed to new nodes.
#[derive(Clone)]
struct Value {
    port: String,
    dtype: DType,
    shape: Vec<usize>,
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const UNARY: [&str; 20] = [
    "Relu",
    "Relu6",
    "Elu",
    "Selu",
    "Tanh",
    "Sigmoid",
    "Exp",
    "Log",
    "Log1p",
    "Sqrt",
    "Rsqrt",
    "Square",
    "Neg",
    "Abs",
    "Erf",
    "Softplus",
    "Reciprocal",
    "Sign",
    "Identity",
    "Gelu",
];
const BINARY: [&str; 8] = [
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Maximum",
    "Minimum",
    "Pow",
    "SquaredDifference",
];

/// Builds a random valid graph as a GraphDef (no top-level dtypes) with attrs in the
/// canonical form ampgraph writes, so what is generated is what a dump shows.
struct Builder {
    rng: Rng,
    nodes: Vec<NodeDef>,
    values: Vec<Value>,
}

impl Builder {
    fn name(&mut self, stem: &str) -> String {
        // Names with punctuation and non-ASCII text; the index keeps them unique.
        let decor = *self.rng.pick(&[
            "", "/", "-", ".", "_", "é", "名前", " ", "\"q\"", "\\", ":x",
        ]);
        format!("{stem}{decor}{}", self.nodes.len())
    }

    fn shape(&mut self) -> Vec<usize> {
        let rank = self.rng.below(5);
        (0..rank).map(|_| 1 + self.rng.below(4)).collect()
    }

    fn annotate(&mut self, attrs: &mut AttrMap) {
        if self.rng.below(4) != 0 {
            return;
        }
        let v = match self.rng.below(6) {
            0 => AttrValue::Bool(self.rng.coin()),
            1 => AttrValue::Int(self.rng.next() as i64),
            2 => AttrValue::Float(self.rng.float() + 0.5),
            3 => AttrValue::Str(
                self.rng
                    .pick(&["", "note", "ünïcödé ✓", "line\nbreak", "{\"json\": 1}"])
                    .to_string(),
            ),
            4 => AttrValue::Ints(
                (0..self.rng.below(4))
                    .map(|_| self.rng.next() as i64 >> 3)
                    .collect(),
            ),
            // Non-empty, with a fraction or non-finite value so it reads back as floats.
            _ => AttrValue::Floats(vec![
                0.25,
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                self.rng.float(),
            ]),
        };
        let key = *self.rng.pick(&["_tool", "_origin", "_x"]);
        attrs.insert(key.to_string(), v);
    }

    fn push(
        &mut self,
        name: String,
        op: &str,
        inputs: Vec<String>,
        mut attrs: AttrMap,
        out: Option<(DType, Vec<usize>)>,
    ) {
        self.annotate(&mut attrs);
        if let Some((dtype, shape)) = out {
            self.values.push(Value {
                port: name.clone(),
                dtype,
                shape,
            });
        }
        self.nodes.push(NodeDef {
            name,
            op: op.to_string(),
            inputs,
            attrs,
            dtype: None,
            values: None,
        });
    }

    fn source(&mut self, dtype: DType, shape: Vec<usize>) -> Value {
        let op = *self.rng.pick(&["Placeholder", "Variable", "Const"]);
        let name = self.name(&op.to_lowercase());
        let mut attrs = AttrMap::new();
        attrs.insert("dtype".into(), dtype.into());
        attrs.insert("shape".into(), shape.as_slice().into());
        if op == "Const" && self.rng.coin() {
            let n: usize = shape.iter().product();
            // Values exact in every float dtype (multiples of 1/16 below 4: bf16 holds 8
            // significant bits), and specials.
            let vals = (0..n)
                .map(|i| match (dtype, i % 7) {
                    (_, 3) => f64::NAN,
                    (_, 5) => f64::NEG_INFINITY,
                    _ => (self.rng.below(128) as f64 - 64.0) / 16.0,
                })
                .collect();
            attrs.insert("value".into(), AttrValue::Floats(vals));
        }
        self.push(
            name.clone(),
            op,
            vec![],
            attrs,
            Some((dtype, shape.clone())),
        );
        Value {
            port: name,
            dtype,
            shape,
        }
    }

    /// A shape `b` such that `a` and `b` broadcast to `a`.
    fn broadcastable(&mut self, a: &[usize]) -> Vec<usize> {
        let keep = self.rng.below(a.len() + 1);
        a[a.len() - keep..]
            .iter()
            .map(|&d| if self.rng.coin() { d } else { 1 })
            .collect()
    }

    fn step(&mut self) {
        let x = self.rng.pick(&self.values).clone();
        let rank = x.shape.len();
        let mut attrs = AttrMap::new();
        let choice = self.rng.below(11);
        match choice {
            0 | 1 => {
                let op = *self.rng.pick(&UNARY);
                if op == "Gelu" {
                    attrs.insert("approximate".into(), self.rng.coin().into());
                }
                let name = self.name(&op.to_lowercase());
                self.push(name, op, vec![x.port], attrs, Some((x.dtype, x.shape)));
            }
            2 => {
                attrs.insert("alpha".into(), AttrValue::Float(self.rng.float() + 0.5));
                let name = self.name("leaky");
                self.push(
                    name,
                    "LeakyRelu",
                    vec![x.port],
                    attrs,
                    Some((x.dtype, x.shape)),
                );
            }
            3 | 4 => {
                let op = *self.rng.pick(&BINARY);
                let other_shape = self.broadcastable(&x.shape);
                let y = if self.rng.below(3) == 0 {
                    x.clone()
                } else {
                    self.source(x.dtype, other_shape)
                };
                // Either order: broadcasting is symmetric.
                let inputs = if self.rng.coin() {
                    vec![x.port, y.port]
                } else {
                    vec![y.port, x.port]
                };
                let name = self.name(&op.to_lowercase());
                self.push(name, op, inputs, attrs, Some((x.dtype, x.shape)));
            }
            5 => {
                // Reshape into a random factorisation, perhaps with one -1.
                let mut n: usize = x.shape.iter().product();
                let mut dims = Vec::new();
                while n > 1 {
                    let f = (2..=n).find(|f| n % f == 0).expect("n > 1 has a factor");
                    let f = if self.rng.coin() && dims.len() < 3 {
                        f
                    } else {
                        n
                    };
                    dims.push(f);
                    n /= f;
                }
                if self.rng.coin() {
                    dims.push(1);
                }
                let mut spec: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
                if !spec.is_empty() && self.rng.coin() {
                    let i = self.rng.below(spec.len());
                    spec[i] = -1;
                }
                attrs.insert("shape".into(), AttrValue::Ints(spec));
                let name = self.name("reshape");
                self.push(name, "Reshape", vec![x.port], attrs, Some((x.dtype, dims)));
            }
            6 => {
                let mut perm: Vec<usize> = (0..rank).collect();
                for i in (1..rank).rev() {
                    let j = self.rng.below(i + 1);
                    perm.swap(i, j);
                }
                let shape = perm.iter().map(|&p| x.shape[p]).collect();
                attrs.insert("perm".into(), perm.as_slice().into());
                let name = self.name("transpose");
                self.push(
                    name,
                    "Transpose",
                    vec![x.port],
                    attrs,
                    Some((x.dtype, shape)),
                );
            }
            7 => {
                let op = *self.rng.pick(&["Sum", "Mean", "Max"]);
                let keep = self.rng.coin();
                let axes: Option<Vec<usize>> = if self.rng.below(4) == 0 {
                    None
                } else {
                    Some((0..rank).filter(|_| self.rng.coin()).collect())
                };
                let reduced = |a: usize| axes.as_ref().is_none_or(|ax| ax.contains(&a));
                let shape: Vec<usize> = (0..rank)
                    .filter_map(|a| match (reduced(a), keep) {
                        (true, true) => Some(1),
                        (true, false) => None,
                        (false, _) => Some(x.shape[a]),
                    })
                    .collect();
                if let Some(axes) = &axes {
                    // Some axes counted from the end.
                    let spelled: Vec<i64> = axes
                        .iter()
                        .map(|&a| {
                            if self.rng.coin() {
                                a as i64
                            } else {
                                a as i64 - rank as i64
                            }
                        })
                        .collect();
                    attrs.insert("axes".into(), AttrValue::Ints(spelled));
                }
                attrs.insert("keep_dims".into(), keep.into());
                let name = self.name(&op.to_lowercase());
                self.push(name, op, vec![x.port], attrs, Some((x.dtype, shape)));
            }
            8 if rank == 2 => {
                let (ta, tb) = (self.rng.coin(), self.rng.coin());
                let (m, k) = if ta {
                    (x.shape[1], x.shape[0])
                } else {
                    (x.shape[0], x.shape[1])
                };
                let n = 1 + self.rng.below(4);
                let w = self.source(x.dtype, if tb { vec![n, k] } else { vec![k, n] });
                attrs.insert("transpose_a".into(), ta.into());
                attrs.insert("transpose_b".into(), tb.into());
                let name = self.name("matmul");
                self.push(
                    name,
                    "MatMul",
                    vec![x.port, w.port],
                    attrs,
                    Some((x.dtype, vec![m, n])),
                );
            }
            9 if rank >= 1 => {
                let op = *self.rng.pick(&["Softmax", "LogSoftmax"]);
                let axis = self.rng.below(2 * rank) as i64 - rank as i64;
                attrs.insert("axis".into(), AttrValue::Int(axis));
                let name = self.name(&op.to_lowercase());
                self.push(name, op, vec![x.port], attrs, Some((x.dtype, x.shape)));
            }
            10 if rank >= 1 => {
                let axis = self.rng.below(rank);
                let mut shape = x.shape.clone();
                shape[axis] *= 2;
                attrs.insert("axis".into(), AttrValue::Int(axis as i64));
                let name = self.name("concat");
                self.push(
                    name,
                    "Concat",
                    vec![x.port.clone(), x.port],
                    attrs,
                    Some((x.dtype, shape)),
                );
            }
            _ => {
                let to = *self.rng.pick(&FLOATS);
                attrs.insert("to".into(), to.into());
                let name = self.name("cast");
                self.push(name, "Cast", vec![x.port], attrs, Some((to, x.shape)));
            }
        }
    }
}

/// A random valid graph of about `size` nodes, with its expected output types.
fn random_graph(seed: u64, size: usize) -> (GraphDef, Vec<(DType, Vec<usize>)>) {
    let mut b = Builder {
        rng: Rng(seed),
        nodes: Vec::new(),
        values: Vec::new(),
    };
    for _ in 0..1 + b.rng.below(3) {
        let dtype = *b.rng.pick(&FLOATS);
        let shape = b.shape();
        b.source(dtype, shape);
    }
    while b.nodes.len() < size {
        b.step();
    }
    let outputs: Vec<Value> = (0..1 + b.rng.below(3))
        .map(|_| b.rng.pick(&b.values).clone())
        .collect();
    let types = outputs.iter().map(|v| (v.dtype, v.shape.clone())).collect();
    let def = GraphDef {
        nodes: b.nodes,
        outputs: outputs.into_iter().map(|v| v.port).collect(),
        mixed_precision: [None, Some(DType::F16), Some(DType::BF16)][b.rng.below(3)],
    };
    (def, types)
}

/// Structural equality that treats NaN as equal to NaN (Const values hold NaNs).
/// The same graph file: a Const's values as an attr (read from JSON) or as values of
/// their own type (from a graph) write the same JSON.
fn same(a: &GraphDef, b: &GraphDef) -> bool {
    format::to_json(a) == format::to_json(b)
}

fn build(def: &GraphDef) -> Result<Graph, TestCaseError> {
    def.to_graph().map_err(|e| {
        TestCaseError::fail(format!(
            "generated graph does not build: {e}\n{}",
            format::to_json(def)
        ))
    })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn json_graph_bin_graph_json_is_the_identity(seed in any::<u64>(), size in 1usize..40) {
        let (generated, types) = random_graph(seed, size);
        let g0 = build(&generated)?;
        // The generator knows the types it made; inference must agree.
        for (port, (dtype, shape)) in generated.outputs.iter().zip(&types) {
            let id = g0.require(port.as_str()).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let t = &g0.node(id).outputs()[0];
            prop_assert_eq!((t.dtype, &t.shape), (*dtype, shape), "type of {}", port);
        }
        // What was generated is what the graph writes, plus each node's dtype.
        let canonical = GraphDef::from_graph(&g0);
        let mut with_dtypes = generated.clone();
        for (n, c) in with_dtypes.nodes.iter_mut().zip(&canonical.nodes) {
            n.dtype = c.dtype;
        }
        prop_assert!(same(&with_dtypes, &canonical), "attrs changed:\n{}\nvs\n{}",
            format::to_json(&with_dtypes), format::to_json(&canonical));

        // JSON -> GraphDef -> Graph -> bin -> Graph -> JSON.
        let json = format::to_json(&canonical);
        let def1 = format::parse_json(json.as_bytes()).map_err(|e| TestCaseError::fail(format!("{e}\n{json}")))?;
        prop_assert!(same(&def1, &canonical));
        let g1 = build(&def1)?;
        let def2 = GraphDef::from_graph(&g1);
        prop_assert!(same(&def2, &canonical));
        let bin = format::to_bin(&def2).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let def3 = format::from_bin(&bin).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(same(&def3, &canonical));
        let g2 = build(&def3)?;
        g2.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let def4 = GraphDef::from_graph(&g2);
        prop_assert!(same(&def4, &canonical));
        prop_assert_eq!(format::to_json(&def4), json.clone());
        // The loaders agree, and the other dumps are stable too.
        let g3 = format::graph_from_bytes(&bin).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(format::to_json(&GraphDef::from_graph(&g3)), json.clone());
        prop_assert_eq!(format::to_text(&g2), format::to_text(&g0));
        prop_assert_eq!(format::to_dot(&g2, &format::default_color), format::to_dot(&g0, &format::default_color));
        prop_assert_eq!(format::to_bin(&def4).map_err(|e| TestCaseError::fail(e.to_string()))?, bin);
    }

    #[test]
    fn mutated_bin_never_panics(
        seed in any::<u64>(),
        size in 1usize..25,
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        inserts in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let (def, _) = random_graph(seed, size);
        let g = build(&def)?;
        let mut bytes = format::to_bin(&GraphDef::from_graph(&g)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (at, byte) in &flips {
            let i = at.index(bytes.len());
            bytes[i] = *byte;
        }
        for (at, byte) in &inserts {
            let i = at.index(bytes.len() + 1);
            bytes.insert(i, *byte);
        }
        if let Some(at) = cut {
            bytes.truncate(at.index(bytes.len() + 1));
        }
        // Ok or Err, never a panic, whatever the bytes; a decoded graph is checked
        // like any other and writes out without panicking.
        if let Ok(def) = format::from_bin(&bytes) {
            let _ = format::to_json(&def);
            if let Ok(g) = def.to_graph() {
                let _ = format::to_text(&g);
                let _ = format::to_bin(&GraphDef::from_graph(&g));
            }
        }
        let _ = format::graph_from_bytes(&bytes);
    }

    #[test]
    fn random_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..300), magic in any::<bool>()) {
        let mut bytes = Vec::new();
        if magic {
            bytes.extend_from_slice(format::BIN_MAGIC);
            bytes.extend_from_slice(&format::BIN_VERSION.to_le_bytes());
        }
        bytes.extend_from_slice(&body);
        let _ = format::from_bin(&bytes);
        let _ = format::graph_from_bytes(&bytes);
    }
}
