//! The MNIST idx reader on the real files (gzip and plain), on corrupt files, and the
//! synthetic data set.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use ampgraph_data::idx::{load_idx_images, load_idx_labels};
use ampgraph_data::{DataError, Dataset, Mnist, Split};
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;

fn mnist_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/mnist")
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ampgraph-data-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn gunzip(path: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    GzDecoder::new(fs::File::open(path).unwrap())
        .read_to_end(&mut out)
        .unwrap();
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = GzEncoder::new(Vec::new(), Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn idx(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut v = magic.to_be_bytes().to_vec();
    for d in dims {
        v.extend(d.to_be_bytes());
    }
    v.extend(data);
    v
}

fn check_t10k(m: &Mnist) {
    assert_eq!(m.len(), 10_000);
    assert_eq!((m.rows(), m.cols(), m.image_size()), (28, 28, 784));
    assert_eq!(m.images().len(), 10_000 * 784);
    assert!(m.labels().iter().all(|&l| l < 10));
    assert_eq!(m.label(0), Some(7));
    let mut counts = [0usize; 10];
    for &l in m.labels() {
        counts[l as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    // A digit has ink in the middle and none in the corner.
    let img = m.image(0).unwrap();
    assert_eq!(img[0], 0);
    assert!(img.iter().filter(|&&p| p > 128).count() > 50);
}

#[test]
fn reads_the_real_gzip_files() {
    let dir = mnist_dir();
    let (rows, cols, pixels) = load_idx_images(dir.join("t10k-images-idx3-ubyte.gz")).unwrap();
    assert_eq!((rows, cols, pixels.len()), (28, 28, 10_000 * 784));
    let labels = load_idx_labels(dir.join("t10k-labels-idx1-ubyte.gz")).unwrap();
    assert_eq!((labels.len(), labels[0]), (10_000, 7));

    let m = Mnist::load(&dir).unwrap();
    check_t10k(&m);
    assert_eq!(Mnist::load_split(&dir, Split::Test).unwrap(), m);
    assert!(matches!(
        Mnist::load_split(&dir, Split::Train),
        Err(DataError::NotFound { .. })
    ));
}

#[test]
fn reads_plain_copies_identically() {
    let src = mnist_dir();
    let dir = scratch("plain");
    for name in ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"] {
        fs::write(dir.join(name), gunzip(&src.join(format!("{name}.gz")))).unwrap();
    }
    let plain = Mnist::load(&dir).unwrap();
    check_t10k(&plain);
    assert_eq!(plain, Mnist::load(&src).unwrap());
    // Detection is by content, not by name: gzip data under a plain name reads too.
    fs::copy(
        src.join("t10k-labels-idx1-ubyte.gz"),
        dir.join("renamed-labels"),
    )
    .unwrap();
    assert_eq!(
        load_idx_labels(dir.join("renamed-labels")).unwrap(),
        plain.labels()
    );

    let first = plain.get(0).unwrap();
    assert_eq!((first.values.len(), first.label), (784, 7));
    assert!(first.values.iter().all(|&p| (0.0..=1.0).contains(&p)));
    assert!(first.values.contains(&1.0));
    let expect: Vec<f32> = plain
        .image(1)
        .unwrap()
        .iter()
        .map(|&p| p as f32 / 255.0)
        .collect();
    let second = plain.get(1).unwrap();
    assert_eq!(second.values, expect);
    assert_eq!(second.label, plain.label(1).unwrap() as i64);
    assert!(matches!(
        plain.get(10_000),
        Err(DataError::Index { index: 10_000, .. })
    ));
    let _ = fs::remove_dir_all(&dir);
}

/// The error of reading `bytes` written to a file, as images or labels.
fn images_err(dir: &Path, name: &str, bytes: &[u8]) -> DataError {
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap();
    let e = load_idx_images(&path).unwrap_err();
    assert!(e.to_string().contains(name), "error names the file: {e}");
    e
}

fn labels_err(dir: &Path, name: &str, bytes: &[u8]) -> DataError {
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap();
    let e = load_idx_labels(&path).unwrap_err();
    assert!(e.to_string().contains(name), "error names the file: {e}");
    e
}

#[test]
fn corrupt_files_are_errors() {
    let dir = scratch("corrupt");
    let good = idx(0x803, &[2, 3, 4], &[7; 24]);
    assert_eq!(
        load_idx_images(write(&dir, "good", &good)).unwrap(),
        (3, 4, vec![7; 24])
    );
    assert_eq!(
        load_idx_images(write(&dir, "good.gz", &gzip(&good))).unwrap(),
        (3, 4, vec![7; 24])
    );

    use DataError::*;
    // Truncated: in the header, in the data, in plain and gzip form.
    assert!(matches!(images_err(&dir, "empty", &[]), Truncated { .. }));
    assert!(matches!(
        images_err(&dir, "hdr", &good[..10]),
        Truncated { .. }
    ));
    assert!(matches!(
        images_err(&dir, "short", &good[..good.len() - 1]),
        Truncated { .. }
    ));
    assert!(matches!(
        images_err(&dir, "short.gz", &gzip(&good[..good.len() - 5])),
        Truncated { .. }
    ));
    // A gzip file cut short is an error too (truncated or a broken stream).
    let gz = gzip(&good);
    assert!(matches!(
        images_err(&dir, "cut.gz", &gz[..gz.len() - 6]),
        Truncated { .. } | Gzip { .. }
    ));
    // A corrupted gzip stream (bad CRC) is an error.
    let mut bad_crc = gz.clone();
    let n = bad_crc.len();
    bad_crc[n - 8] ^= 0xff;
    assert!(matches!(images_err(&dir, "crc.gz", &bad_crc), Gzip { .. }));

    // Bad magic: labels read as images and the other way round, and garbage.
    let labels = idx(0x801, &[3], &[1, 2, 3]);
    assert!(matches!(
        images_err(&dir, "labels-as-images", &labels),
        BadMagic {
            found: 0x801,
            expected: 0x803,
            ..
        }
    ));
    assert!(matches!(
        labels_err(&dir, "images-as-labels", &good),
        BadMagic { .. }
    ));
    assert!(matches!(
        images_err(&dir, "text", b"hello, world, not idx"),
        BadMagic { .. }
    ));

    // Trailing data: more bytes than the header declares.
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(
        images_err(&dir, "long", &long),
        CountMismatch { .. }
    ));
    assert!(matches!(
        labels_err(&dir, "long-labels.gz", &gzip(&idx(0x801, &[2], &[1, 2, 3]))),
        CountMismatch { .. }
    ));

    // Zero dimensions and absurd counts (no allocation of the declared size).
    assert!(matches!(
        images_err(&dir, "zero", &idx(0x803, &[2, 0, 4], &[])),
        BadDims { .. }
    ));
    let huge = idx(0x803, &[u32::MAX, u32::MAX, u32::MAX], &[0; 16]);
    assert!(matches!(images_err(&dir, "huge", &huge), Truncated { .. }));
    assert!(matches!(
        images_err(&dir, "huge.gz", &gzip(&huge)),
        Truncated { .. }
    ));
    let many = idx(0x801, &[u32::MAX], &[0; 16]);
    assert!(matches!(labels_err(&dir, "many", &many), Truncated { .. }));

    // Missing files.
    assert!(matches!(
        load_idx_labels(dir.join("absent")),
        Err(Io { .. })
    ));
    assert!(matches!(
        Mnist::load(dir.join("absent-dir")),
        Err(NotFound { .. })
    ));

    // A directory whose files disagree: labels out of range, counts differ.
    let set = scratch("corrupt-set");
    write(
        &set,
        "t10k-images-idx3-ubyte",
        &idx(0x803, &[2, 2, 2], &[0; 8]),
    );
    write(&set, "t10k-labels-idx1-ubyte", &idx(0x801, &[2], &[3, 10]));
    assert!(matches!(
        Mnist::load(&set),
        Err(BadLabel {
            index: 1,
            label: 10,
            ..
        })
    ));
    write(
        &set,
        "t10k-labels-idx1-ubyte",
        &idx(0x801, &[3], &[3, 1, 2]),
    );
    let e = Mnist::load(&set).unwrap_err();
    assert!(matches!(e, CountMismatch { .. }), "{e}");
    write(&set, "t10k-labels-idx1-ubyte", &idx(0x801, &[2], &[3, 1]));
    assert_eq!(Mnist::load(&set).unwrap().len(), 2);
    let _ = fs::remove_dir_all(&dir);
    let _ = fs::remove_dir_all(&set);
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn synthetic_is_deterministic_and_balanced() {
    let a = Mnist::synthetic(1000, 42);
    assert_eq!(a, Mnist::synthetic(1000, 42));
    assert_ne!(a.images(), Mnist::synthetic(1000, 43).images());
    assert_eq!((a.len(), a.rows(), a.cols()), (1000, 28, 28));
    let mut counts = [0usize; 10];
    for &l in a.labels() {
        counts[l as usize] += 1;
    }
    assert_eq!(counts, [100; 10]);
    // A prefix of a larger set is the smaller set.
    assert_eq!(Mnist::synthetic(50, 42), a.slice(0, 50));

    // Learnable: each example is nearer its own class mean than any other class mean
    // for the large majority (a nearest-centroid classifier).
    let train = Mnist::synthetic(2000, 1);
    let test = Mnist::synthetic(500, 2);
    let mut means = vec![[0f64; 784]; 10];
    for i in 0..train.len() {
        let c = train.label(i).unwrap() as usize;
        for (m, &p) in means[c].iter_mut().zip(train.image(i).unwrap()) {
            *m += p as f64 / 200.0;
        }
    }
    let correct = (0..test.len())
        .filter(|&i| {
            let img = test.image(i).unwrap();
            let dist = |m: &[f64; 784]| -> f64 {
                m.iter()
                    .zip(img)
                    .map(|(a, &b)| (a - b as f64).powi(2))
                    .sum()
            };
            let best = (0..10)
                .min_by(|&x, &y| dist(&means[x]).total_cmp(&dist(&means[y])))
                .unwrap();
            best == test.label(i).unwrap() as usize
        })
        .count();
    assert!(correct > 350, "nearest centroid got {correct}/500");
    // ... but not trivially: it is not perfect.
    assert!(correct < 500, "nearest centroid got {correct}/500");
}

#[test]
fn new_checks_its_parts() {
    assert!(Mnist::new(2, 2, vec![0; 8], vec![1, 2]).is_ok());
    assert!(Mnist::new(2, 2, vec![0; 8], vec![1]).is_err());
    assert!(Mnist::new(2, 2, vec![0; 7], vec![1, 2]).is_err());
    assert!(Mnist::new(0, 2, vec![], vec![]).is_err());
    assert!(Mnist::new(2, 2, vec![0; 8], vec![1, 11]).is_err());
}

/// Half a split is an error naming the file that is missing, not a reason to train on
/// the other split (train-images beside the t10k files, without train-labels, trained
/// on t10k silently).
#[test]
fn half_a_split_names_the_missing_file() {
    let dir = scratch("half-split");
    for f in ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"] {
        std::fs::copy(mnist_dir().join(f), dir.join(f)).unwrap();
    }
    std::fs::copy(
        mnist_dir().join("t10k-images-idx3-ubyte.gz"),
        dir.join("train-images-idx3-ubyte.gz"),
    )
    .unwrap();
    let err = Mnist::load(&dir).unwrap_err().to_string();
    assert!(
        err.contains("train-images-idx3-ubyte.gz is there but train-labels-idx1-ubyte[.gz] is not"),
        "{err}"
    );
    let empty = scratch("no-mnist");
    let err = Mnist::load(&empty).unwrap_err().to_string();
    assert!(err.contains("no MNIST files found"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&empty);
}
