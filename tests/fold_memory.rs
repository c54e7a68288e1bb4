//! What computing a constant costs in memory (issue 46): a broadcast Add of two small
//! constants makes a 64 MiB result; the op's CPU kernel, and the ONNX import folding
//! it into one Const, may take at most a quarter more than the result at their peak.
//! (Index tables of the output's size took 16 bytes an element more, and the Const
//! node a copy of its tensor: a 1 GiB folded Add peaked at 5.2 GB for `dump`.)
//!
//! One test in this binary: the allocator below counts every thread's allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use ampgraph::graph::ops::{Binary, BinaryKind, Const};
use ampgraph::graph::{DType, Data, Graph, Op, Tensor};
use ampgraph::onnx::{export, import_model, ExportOptions, ImportOptions};

/// The system allocator, counting the bytes held now and their peak.
struct Counting;

static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = HELD.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, layout) }
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, layout, size) };
        if !q.is_null() {
            HELD.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(size);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// `f`'s result, and the most bytes held during it beyond those held before.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = HELD.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed) - before)
}

#[test]
fn a_folded_broadcast_constant_takes_about_its_own_size() {
    const N: usize = 4096;
    let result = N * N * 4;
    let column: Vec<f64> = (0..N).map(|i| (i % 7) as f64).collect();
    let row: Vec<f64> = (0..N).map(|j| (j % 5) as f64 * 0.5).collect();
    let a = Tensor::from_f64(DType::F32, vec![N, 1], &column).unwrap();
    let b = Tensor::from_f64(DType::F32, vec![1, N], &row).unwrap();

    let add = Binary::new(BinaryKind::Add);
    let (sum, peak) = peak_during(|| add.eval(&[&a, &b]).unwrap());
    assert!(
        peak <= result + result / 4,
        "the kernel held {peak} bytes for a {result}-byte result"
    );
    drop(sum);

    // y = (a + b) * x as an ONNX model: the import folds a + b into one Const.
    let mut g = Graph::new();
    let ca = g.add_node("a", Box::new(Const::new(a)), &[]).unwrap();
    let cb = g.add_node("b", Box::new(Const::new(b)), &[]).unwrap();
    let x = g.placeholder("x", DType::F32, [N, N]).unwrap();
    let s = g.add(add, &[ca.into(), cb.into()]).unwrap();
    let y = g.mul(s, x).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let model = export(&g, &ExportOptions::default()).unwrap();
    drop(g);
    let (imported, peak) =
        peak_during(|| import_model(&model, None, &ImportOptions::default()).unwrap());
    assert!(
        peak <= result + result / 4,
        "the import held {peak} bytes for a {result}-byte constant"
    );
    // The folded constant holds a[i] + b[j].
    let folded = (imported.node_ids())
        .filter_map(|id| imported.node(id).op.downcast_ref::<Const>())
        .find(|c| c.ty.shape == [N, N])
        .expect("the sum folded into one Const");
    let Some(Data::F32(values)) = folded.values.as_deref() else {
        panic!("the folded Const holds no f32 values");
    };
    for (i, j) in [(0, 0), (1, 2), (N - 1, N - 1), (1234, 77)] {
        let want = column[i] + row[j];
        assert_eq!(f64::from(values[i * N + j]), want, "element [{i}, {j}]");
    }
}
