//! The builder methods on `Graph` and the `nn` layers: the right ops, names, shapes
//! and variables, and errors (with the graph untouched) for inputs that do not fit.

use ampgraph_graph::nn::{self, Activation};
use ampgraph_graph::ops::{DataFormat, Padding};
use ampgraph_graph::{DType, Graph, Port, Tensor};

type R = ampgraph_graph::Result<()>;

fn op(g: &Graph, p: Port) -> &'static str {
    g.node(p.node).op_name()
}

fn shape(g: &Graph, p: Port) -> Vec<usize> {
    g.ty(p).shape.clone()
}

#[test]
fn sources() -> R {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [4, 3])?;
    let w = g.variable("w", DType::F16, vec![3, 2])?;
    let c = g.constant(Tensor::from_f64(DType::F32, [2], &[1.0, 2.0]).unwrap())?;
    let s = g.scalar(DType::F64, 0.5)?;
    assert_eq!(
        (op(&g, x), g.node(x.node).name.as_str()),
        ("Placeholder", "x")
    );
    assert_eq!((op(&g, w), g.node(w.node).name.as_str()), ("Variable", "w"));
    assert_eq!(g.ty(w).dtype, DType::F16);
    assert_eq!((op(&g, c), shape(&g, c)), ("Const", vec![2]));
    assert_eq!(
        (op(&g, s), shape(&g, s), g.ty(s).dtype),
        ("Const", vec![], DType::F64)
    );
    // Names are unique: a second constant gets a fresh one, a repeated explicit name fails.
    assert_ne!(g.node(c.node).name, g.node(s.node).name);
    assert!(g.placeholder("x", DType::F32, [1]).is_err());
    assert!(g.variable("huge", DType::F32, [usize::MAX, 2]).is_err());
    Ok(())
}

#[test]
fn linear_algebra_and_names() -> R {
    let mut g = Graph::new();
    let a = g.placeholder("a", DType::F32, [4, 3])?;
    let b = g.placeholder("b", DType::F32, [3, 5])?;
    let y = g.matmul(a, b)?;
    assert_eq!((op(&g, y), shape(&g, y)), ("MatMul", vec![4, 5]));
    assert_eq!(g.node(y.node).name, "matmul");
    let y2 = g.matmul_t(b, a, true, true)?;
    assert_eq!(shape(&g, y2), [5, 4]);
    assert!(g.node(y2.node).name.starts_with("matmul_"));
    // Mismatched inner dimensions: an error naming the node, nothing added.
    let n = g.len();
    let err = g.matmul(a, a).unwrap_err().to_string();
    assert!(err.contains("MatMul"), "{err}");
    assert_eq!(g.len(), n);

    let p = g.placeholder("p", DType::F32, [2, 4, 3])?;
    let q = g.placeholder("q", DType::F32, [3, 6])?;
    let q3 = g.reshape(q, [1, 3, 6])?;
    let bm = g.batch_matmul(p, q3)?;
    assert_eq!((op(&g, bm), shape(&g, bm)), ("BatchMatMul", vec![2, 4, 6]));
    let bt = g.batch_matmul_adj(p, p, true, false)?;
    assert_eq!(shape(&g, bt), [2, 3, 3]);
    assert!(g.batch_matmul(p, p).is_err());
    Ok(())
}

#[test]
fn convolution_pooling_norms() -> R {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [2, 8, 8, 3])?;
    let f = g.variable("f", DType::F32, [3, 3, 3, 4])?;
    let y = g.conv2d(x, f, [1, 1], Padding::Same, DataFormat::Nhwc)?;
    assert_eq!((op(&g, y), shape(&g, y)), ("Conv2D", vec![2, 8, 8, 4]));
    let v = g.conv2d(x, f, [2, 2], Padding::Valid, DataFormat::Nhwc)?;
    assert_eq!(shape(&g, v), [2, 3, 3, 4]);
    // PyTorch's padding=1 at stride 2; 3 zeros after the rows: 8 + 3 - 3 + 1 of them.
    let (torch, rows) = ([[1, 1]; 2], [[0, 3], [0, 0]]);
    let p = g.conv2d(x, f, [2, 2], Padding::Explicit(torch), DataFormat::Nhwc)?;
    assert_eq!(shape(&g, p), [2, 4, 4, 4]);
    let p = g.conv2d(x, f, [1, 1], Padding::Explicit(rows), DataFormat::Nhwc)?;
    assert_eq!(shape(&g, p), [2, 9, 6, 4]);
    let bad = g.variable("bad", DType::F32, [3, 3, 5, 4])?;
    assert!(g
        .conv2d(x, bad, [1, 1], Padding::Same, DataFormat::Nhwc)
        .is_err());

    let m = g.max_pool(y, [2, 2], [2, 2], Padding::Valid, DataFormat::Nhwc)?;
    assert_eq!((op(&g, m), shape(&g, m)), ("MaxPool", vec![2, 4, 4, 4]));
    let a = g.avg_pool(y, [3, 3], [1, 1], Padding::Same, DataFormat::Nhwc)?;
    assert_eq!((op(&g, a), shape(&g, a)), ("AvgPool", vec![2, 8, 8, 4]));

    let stats: Vec<Port> = (0..4)
        .map(|i| g.variable(format!("s{i}"), DType::F32, [4]))
        .collect::<Result<_, _>>()?;
    let bn = g.batch_norm(y, stats[0], stats[1], stats[2], stats[3], true)?;
    assert_eq!((op(&g, bn), shape(&g, bn)), ("BatchNorm", vec![2, 8, 8, 4]));
    assert_eq!(g.node(bn.node).outputs().len(), 3);
    assert!(g
        .batch_norm(x, stats[0], stats[1], stats[2], stats[3], false)
        .is_err());

    let gamma = g.variable("gamma", DType::F32, [4])?;
    let beta = g.variable("beta", DType::F32, [4])?;
    let ln = g.layer_norm(y, gamma, beta, -1, 1e-5)?;
    assert_eq!((op(&g, ln), shape(&g, ln)), ("LayerNorm", vec![2, 8, 8, 4]));
    assert!(g.layer_norm(x, gamma, beta, -1, 1e-5).is_err());
    Ok(())
}

#[test]
fn elementwise() -> R {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [4, 3])?;
    type Un = fn(&mut Graph, Port) -> ampgraph_graph::Result<Port>;
    let unary: [(Un, &str); 19] = [
        (Graph::relu, "Relu"),
        (Graph::relu6, "Relu6"),
        (Graph::elu, "Elu"),
        (Graph::selu, "Selu"),
        (Graph::tanh, "Tanh"),
        (Graph::sigmoid, "Sigmoid"),
        (Graph::exp, "Exp"),
        (Graph::log, "Log"),
        (Graph::log1p, "Log1p"),
        (Graph::sqrt, "Sqrt"),
        (Graph::rsqrt, "Rsqrt"),
        (Graph::square, "Square"),
        (Graph::neg, "Neg"),
        (Graph::abs, "Abs"),
        (Graph::erf, "Erf"),
        (Graph::softplus, "Softplus"),
        (Graph::reciprocal, "Reciprocal"),
        (Graph::sign, "Sign"),
        (Graph::identity, "Identity"),
    ];
    for (f, name) in unary {
        let y = f(&mut g, x)?;
        assert_eq!((op(&g, y), shape(&g, y)), (name, vec![4, 3]));
        assert!(g.node(y.node).name.starts_with(&name.to_lowercase()));
    }
    let y = g.gelu(x, true)?;
    assert_eq!(op(&g, y), "Gelu");
    let y = g.leaky_relu(x, 0.1)?;
    assert_eq!(op(&g, y), "LeakyRelu");

    let row = g.placeholder("row", DType::F32, [3])?;
    type Bin = fn(&mut Graph, Port, Port) -> ampgraph_graph::Result<Port>;
    let binary: [(Bin, &str); 8] = [
        (Graph::plus, "Add"),
        (Graph::sub, "Sub"),
        (Graph::mul, "Mul"),
        (Graph::div, "Div"),
        (Graph::maximum, "Maximum"),
        (Graph::minimum, "Minimum"),
        (Graph::pow, "Pow"),
        (Graph::squared_difference, "SquaredDifference"),
    ];
    let other = g.placeholder("other", DType::F32, [5])?;
    for (f, name) in binary {
        let y = f(&mut g, x, row)?;
        assert_eq!((op(&g, y), shape(&g, y)), (name, vec![4, 3]));
        assert!(
            f(&mut g, x, other).is_err(),
            "{name} broadcasts [4,3] with [5]"
        );
    }
    let b = g.bias_add(x, row)?;
    assert_eq!((op(&g, b), shape(&g, b)), ("BiasAdd", vec![4, 3]));
    assert!(g.bias_add(x, other).is_err());
    let img = g.placeholder("img", DType::F32, [2, 5, 4, 4])?;
    let b = g.bias_add_format(img, other, DataFormat::Nchw)?;
    assert_eq!(shape(&g, b), [2, 5, 4, 4]);
    let h = g.placeholder("h", DType::F16, [4, 3])?;
    assert!(g.plus(x, h).is_err(), "mixed dtypes");
    Ok(())
}

#[test]
fn softmax_reductions_shapes_cast() -> R {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [4, 3])?;
    let labels = g.placeholder("labels", DType::I64, [4])?;
    let s = g.softmax(x, -1)?;
    assert_eq!((op(&g, s), shape(&g, s)), ("Softmax", vec![4, 3]));
    let l = g.log_softmax(x, 0)?;
    assert_eq!(op(&g, l), "LogSoftmax");
    assert!(g.softmax(x, 2).is_err());
    let loss = g.softmax_cross_entropy(x, labels)?;
    assert_eq!(
        (op(&g, loss), shape(&g, loss)),
        ("SoftmaxCrossEntropy", vec![])
    );
    assert!(g.softmax_cross_entropy(x, x).is_err(), "float labels");

    let t = g.sum(x, None, false)?;
    assert_eq!((op(&g, t), shape(&g, t)), ("Sum", vec![]));
    let m = g.mean(x, Some(&[0]), true)?;
    assert_eq!((op(&g, m), shape(&g, m)), ("Mean", vec![1, 3]));
    let mx = g.max(x, Some(&[-1]), false)?;
    assert_eq!((op(&g, mx), shape(&g, mx)), ("Max", vec![4]));
    assert!(g.sum(x, Some(&[5]), false).is_err());

    let r = g.reshape(x, [-1, 6])?;
    assert_eq!((op(&g, r), shape(&g, r)), ("Reshape", vec![2, 6]));
    assert!(g.reshape(x, [5]).is_err());
    let tr = g.transpose(x, [1, 0])?;
    assert_eq!((op(&g, tr), shape(&g, tr)), ("Transpose", vec![3, 4]));
    assert!(g.transpose(x, [0, 0]).is_err());
    let c = g.concat(&[x, x, x], 1)?;
    assert_eq!((op(&g, c), shape(&g, c)), ("Concat", vec![4, 9]));
    assert!(g.concat(&[x, tr], 0).is_err());
    let h = g.cast(x, DType::F16)?;
    assert_eq!((op(&g, h), g.ty(h).dtype), ("Cast", DType::F16));
    assert_eq!(g.node(h.node).name, "cast");
    g.validate()?;
    Ok(())
}

#[test]
fn dense_layers() -> R {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [128, 784])?;
    let labels = g.placeholder("labels", DType::I64, [128])?;
    let h = nn::dense(&mut g, x, 512, Some(Activation::Gelu))?;
    assert_eq!((op(&g, h), shape(&g, h)), ("Gelu", vec![128, 512]));
    let d = nn::dense_layer(&mut g, h, 10, None)?;
    assert_eq!(
        (op(&g, d.output), shape(&g, d.output)),
        ("BiasAdd", vec![128, 10])
    );
    let loss = g.softmax_cross_entropy(d.output, labels)?;
    assert_eq!(shape(&g, loss), Vec::<usize>::new());

    for (name, dims) in [
        ("dense/kernel", vec![784, 512]),
        ("dense/bias", vec![512]),
        ("dense_1/kernel", vec![512, 10]),
        ("dense_1/bias", vec![10]),
    ] {
        let id = g.require(name)?;
        assert_eq!(g.node(id).op_name(), "Variable", "{name}");
        assert_eq!(g.node(id).outputs()[0].shape, dims, "{name}");
        assert_eq!(g.node(id).outputs()[0].dtype, DType::F32, "{name}");
    }
    assert_eq!(d.kernel, g.require("dense_1/kernel")?.into());
    assert_eq!(d.bias, g.require("dense_1/bias")?.into());
    assert_eq!(op(&g, g.require("dense/matmul")?.into()), "MatMul");
    for (act, name) in [
        (Activation::Relu, "Relu"),
        (Activation::Tanh, "Tanh"),
        (Activation::Sigmoid, "Sigmoid"),
    ] {
        let y = nn::dense(&mut g, x, 3, Some(act))?;
        assert_eq!(op(&g, y), name);
    }
    g.validate()?;

    // Wrong rank and zero units are errors that leave the graph as it was.
    let n = g.len();
    let img = g.placeholder("img", DType::F32, [2, 4, 4, 1])?;
    assert!(nn::dense(&mut g, img, 3, None).is_err());
    assert!(nn::dense(&mut g, x, 0, None).is_err());
    assert!(nn::dense(&mut g, labels, 3, None).is_err(), "integer input");
    assert_eq!(g.len(), n + 1);
    // A port that is not in the graph is an error, not a panic.
    let mut other = Graph::new();
    assert!(nn::dense(&mut other, h, 3, None).is_err());
    assert!(other.is_empty());
    Ok(())
}

#[test]
fn conv_and_batch_norm_layers() -> R {
    let mut g = Graph::new();
    let x = g.placeholder("x", DType::F32, [8, 28, 28, 1])?;
    let c = nn::conv2d_layer(
        &mut g,
        x,
        16,
        [5, 5],
        [1, 1],
        Padding::Same,
        Some(Activation::Relu),
    )?;
    assert_eq!(
        (op(&g, c.output), shape(&g, c.output)),
        ("Relu", vec![8, 28, 28, 16])
    );
    assert_eq!(shape(&g, c.kernel), [5, 5, 1, 16]);
    assert_eq!(shape(&g, c.bias), [16]);
    assert_eq!(c.kernel, g.require("conv2d/kernel")?.into());
    let c2 = nn::conv2d_layer(&mut g, c.output, 8, [3, 3], [2, 2], Padding::Valid, None)?;
    assert_eq!(shape(&g, c2.output), [8, 13, 13, 8]);
    let explicit = Padding::Explicit([[1, 1]; 2]);
    let c3 = nn::conv2d_layer(&mut g, c2.output, 4, [3, 3], [2, 2], explicit, None)?;
    assert_eq!(shape(&g, c3.output), [8, 7, 7, 4]);
    assert_eq!(
        shape(&g, g.require("conv2d_1/kernel")?.into()),
        [3, 3, 16, 8]
    );

    let bn = nn::batch_norm_layer(&mut g, c2.output, true)?;
    assert_eq!(
        (op(&g, bn.output), shape(&g, bn.output)),
        ("BatchNorm", vec![8, 13, 13, 8])
    );
    for (p, name) in [
        (bn.scale, "batch_norm/scale"),
        (bn.offset, "batch_norm/offset"),
        (bn.moving_mean, "batch_norm/moving_mean"),
        (bn.moving_variance, "batch_norm/moving_variance"),
    ] {
        assert_eq!(p, g.require(name)?.into());
        assert_eq!(op(&g, p), "Variable");
        assert_eq!(shape(&g, p), [8]);
        assert_eq!(g.ty(p).dtype, DType::F32);
    }
    assert_eq!(shape(&g, bn.batch_mean), [8]);
    assert_eq!(bn.batch_variance, Port::new(bn.output.node, 2));
    // f16 activations keep f32 statistics.
    let xh = g.placeholder("xh", DType::F16, [4, 6])?;
    let bnh = nn::batch_norm_layer(&mut g, xh, false)?;
    assert_eq!(g.ty(bnh.output).dtype, DType::F16);
    assert_eq!(g.ty(bnh.scale).dtype, DType::F32);
    g.validate()?;

    let n = g.len();
    assert!(nn::conv2d_layer(&mut g, xh, 4, [3, 3], [1, 1], Padding::Same, None).is_err());
    assert!(nn::conv2d_layer(&mut g, x, 4, [29, 29], [1, 1], Padding::Valid, None).is_err());
    let v = g.placeholder("v", DType::F32, [2, 3, 4])?;
    assert!(nn::batch_norm_layer(&mut g, v, true).is_err());
    assert_eq!(g.len(), n + 1);
    Ok(())
}
