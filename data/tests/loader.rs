//! The loader: the same batches for any number of workers, every example once an
//! epoch, a resumed epoch continuing the exact sequence, and bad examples or files
//! ending an epoch with an error naming them (never a hang); the image folder's
//! decoding against hand-made images.

use std::path::PathBuf;
use std::sync::Arc;

use ampgraph_data::{
    DataError, Dataset, Example, ImageFolder, Loader, LoaderOptions, Mnist, TensorDataset,
    Transform,
};
use ampgraph_graph::{Data, Tensor};

fn options(batch_size: usize, workers: usize, prefetch: usize) -> LoaderOptions {
    LoaderOptions {
        batch_size,
        shuffle: true,
        drop_last: false,
        seed: 7,
        workers,
        prefetch,
        shard: None,
    }
}

#[path = "common/batches.rs"]
mod batches;

use batches::{collect, seen, Seen};

fn digits(n: usize) -> Arc<Mnist> {
    Arc::new(Mnist::synthetic(n, 3))
}

fn augment() -> Vec<Transform> {
    vec![
        Transform::RandomCrop { padding: 2 },
        Transform::RandomFlip,
        Transform::normalize(&[0.1307], &[0.3081]),
    ]
}

#[test]
fn the_batches_are_the_same_for_any_number_of_workers() {
    let data = digits(203);
    let reference = Loader::new(data.clone(), options(16, 0, 1))
        .unwrap()
        .with_transforms(augment());
    let want = collect(&reference, 2);
    assert_eq!(want.len(), 13, "12 full batches and one of 11");
    assert_eq!(want[12].1.len(), 11);
    // Images as the data set gives them, transformed by the example's own generator.
    let first = &want[0];
    let example = data.get(first.1[0]).unwrap();
    assert_eq!(first.2.len(), 16 * 784);
    assert_eq!(first.3[0], example.label as f64);
    for (workers, prefetch) in [(1, 1), (2, 3), (5, 2), (8, 16)] {
        let loader = Loader::new(data.clone(), options(16, workers, prefetch))
            .unwrap()
            .with_transforms(augment());
        assert_eq!(
            collect(&loader, 2),
            want,
            "{workers} workers, {prefetch} ahead"
        );
    }
    // Another epoch, another order and other crops.
    assert_ne!(collect(&reference, 3), want);
}

#[test]
fn every_example_comes_once_an_epoch() {
    let data = digits(100);
    for drop_last in [false, true] {
        let loader = Loader::new(
            data.clone(),
            LoaderOptions {
                drop_last,
                ..options(7, 3, 4)
            },
        )
        .unwrap();
        let mut seen: Vec<usize> = collect(&loader, 0)
            .into_iter()
            .flat_map(|(_, indices, _, _)| indices)
            .collect();
        let count = seen.len();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), count, "no example twice");
        assert_eq!(count, if drop_last { 98 } else { 100 });
        assert_eq!(loader.batches_per_epoch(), if drop_last { 14 } else { 15 });
    }
    // Unshuffled: the data set's order.
    let plain = Loader::new(
        data,
        LoaderOptions {
            shuffle: false,
            ..options(10, 2, 2)
        },
    )
    .unwrap();
    assert_eq!(collect(&plain, 5)[1].1, (10..20).collect::<Vec<_>>());
}

#[test]
fn a_resumed_epoch_continues_the_exact_sequence() {
    let loader = Loader::new(digits(120), options(8, 3, 2))
        .unwrap()
        .with_transforms(augment());
    let whole = collect(&loader, 4);
    let resumed: Vec<Seen> = loader.epoch_from(4, 6).map(seen).collect();
    assert_eq!(resumed, whole[6..]);
}

/// A data set whose example `bad` fails (or panics) and whose others are constant.
struct Faulty {
    bad: usize,
    panics: bool,
}

impl Dataset for Faulty {
    fn len(&self) -> usize {
        64
    }
    fn shape(&self) -> &[usize] {
        &[2]
    }
    fn classes(&self) -> usize {
        2
    }
    fn get(&self, index: usize) -> ampgraph_data::Result<Example> {
        if index == self.bad {
            if self.panics {
                panic!("example {index} blew up");
            }
            return Err(DataError::Decode {
                path: format!("img{index}.png"),
                msg: "bad huffman code".into(),
            });
        }
        Ok(Example {
            values: vec![index as f32; 2],
            label: (index % 2) as i64,
        })
    }
    fn describe(&self) -> String {
        "faulty set".into()
    }
}

#[test]
fn a_bad_example_ends_the_epoch_with_an_error_naming_it() {
    for workers in [0, 1, 4] {
        for panics in [false, true] {
            let loader = Loader::new(
                Arc::new(Faulty { bad: 37, panics }),
                LoaderOptions {
                    shuffle: false,
                    ..options(4, workers, 3)
                },
            )
            .unwrap();
            let mut epoch = loader.epoch(0);
            for number in 0..9 {
                assert_eq!(epoch.next().unwrap().unwrap().number, number);
            }
            // Batch 9 holds examples 36..40.
            let err = epoch.next().unwrap().unwrap_err().to_string();
            let want = match panics {
                false => {
                    "faulty set: example 37: img37.png: cannot decode the image: bad huffman code"
                }
                true => "a loader worker failed making batch 9: example 37 blew up",
            };
            assert_eq!(err, want, "{workers} workers");
            assert!(epoch.next().is_none(), "the epoch ends at its error");
        }
    }
}

#[test]
fn a_label_out_of_range_or_a_short_example_is_an_error() {
    let images = Tensor::new([3, 2], Data::F32(vec![0.0; 6])).unwrap();
    let labels = Tensor::new([3], Data::I64(vec![0, 1, 5])).unwrap();
    let err = TensorDataset::new(&images, &labels, 3).unwrap_err();
    assert_eq!(err.to_string(), "label 5 at index 2 is not a class in 0..3");
    let labels = Tensor::new([2], Data::I64(vec![0, 1])).unwrap();
    let err = TensorDataset::new(&images, &labels, 3).unwrap_err();
    assert!(err.to_string().contains("3 images but labels of shape [2]"));
    let ok = Tensor::new([3], Data::I64(vec![0, 1, 2])).unwrap();
    let set = TensorDataset::new(&images, &ok, 3).unwrap();
    assert_eq!(set.get(2).unwrap().label, 2);
    assert!(matches!(
        set.get(3),
        Err(DataError::Index { index: 3, len: 3 })
    ));
    assert!(Loader::new(Arc::new(set), options(0, 0, 1)).is_err());
}

/// A fresh folder under the target directory.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ampgraph-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn save_rgb(path: &PathBuf, w: u32, h: u32, pixel: impl Fn(u32, u32) -> [u8; 3]) {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb(pixel(x, y)));
    img.save(path).unwrap();
}

#[test]
fn an_image_folder_decodes_planar_channels_and_refuses_bad_files() {
    let root = scratch("folder");
    for class in ["cat", "dog"] {
        std::fs::create_dir(root.join(class)).unwrap();
    }
    // cat/a.png: 3x2 RGB, pixel (x, y) = (10x, 20y, 7); dog/b.png all 255.
    save_rgb(&root.join("cat/a.png"), 3, 2, |x, y| {
        [10 * x as u8, 20 * y as u8, 7]
    });
    save_rgb(&root.join("dog/b.png"), 3, 2, |_, _| [255, 255, 255]);
    std::fs::write(root.join("dog/notes.txt"), "not an image").unwrap();
    let set = ImageFolder::open(&root).unwrap();
    assert_eq!(set.class_names(), ["cat", "dog"]);
    assert_eq!(
        (set.len(), set.shape(), set.classes()),
        (2, &[3, 2, 3][..], 2)
    );
    let a = set.get(0).unwrap();
    let want: Vec<f32> = [
        [0.0, 10.0, 20.0, 0.0, 10.0, 20.0],
        [0.0, 0.0, 0.0, 20.0, 20.0, 20.0],
        [7.0; 6],
    ]
    .iter()
    .flatten()
    .map(|v| v / 255.0)
    .collect();
    assert_eq!((a.values, a.label), (want, 0));
    assert_eq!(set.get(1).unwrap().values, vec![1.0; 18]);

    // An image of another size, a corrupt file, an empty class folder.
    save_rgb(&root.join("dog/c.png"), 4, 2, |_, _| [0, 0, 0]);
    let set = ImageFolder::open(&root).unwrap();
    let err = set.get(2).unwrap_err().to_string();
    assert!(err.ends_with("dog/c.png: [3, 2, 4] (channels, height, width), but the data set's images are [3, 2, 3]"), "{err}");
    std::fs::write(root.join("dog/c.png"), b"\x89PNG\r\n\x1a\n broken").unwrap();
    let err = ImageFolder::open(&root)
        .unwrap()
        .get(2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("dog/c.png: cannot decode the image"), "{err}");
    std::fs::create_dir(root.join("emu")).unwrap();
    let err = ImageFolder::open(&root).unwrap_err().to_string();
    assert!(
        err.ends_with("emu: the class folder holds no images (PNG or JPEG)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn an_image_folder_reads_grey_and_16_bit_images_in_their_own_channels() {
    let root = scratch("grey");
    std::fs::create_dir(root.join("only")).unwrap();
    // 2x1 grey at 16 bits: 0 and 65535; beside it nothing else.
    let img = image::ImageBuffer::<image::Luma<u16>, _>::from_raw(2, 1, vec![0u16, 65535]).unwrap();
    img.save(root.join("only/g.png")).unwrap();
    let set = ImageFolder::open(&root).unwrap();
    assert_eq!(set.shape(), [1, 1, 2]);
    assert_eq!(set.get(0).unwrap().values, [0.0, 1.0]);
    // 8-bit grey with alpha: two planes.
    let img = image::GrayAlphaImage::from_raw(2, 1, vec![51, 255, 102, 0]).unwrap();
    std::fs::remove_file(root.join("only/g.png")).unwrap();
    img.save(root.join("only/a.png")).unwrap();
    let set = ImageFolder::open(&root).unwrap();
    assert_eq!(set.shape(), [2, 1, 2]);
    assert_eq!(set.get(0).unwrap().values, [0.2, 0.4, 1.0, 0.0]);
    let _ = std::fs::remove_dir_all(&root);
}

/// Examples as large as a header may declare (a 4 TiB image).
struct Huge([usize; 3]);

impl ampgraph_data::Dataset for Huge {
    fn len(&self) -> usize {
        2
    }
    fn shape(&self) -> &[usize] {
        &self.0
    }
    fn classes(&self) -> usize {
        2
    }
    fn get(&self, index: usize) -> ampgraph_data::Result<ampgraph_data::Example> {
        Err(ampgraph_data::DataError::Index { index, len: 2 })
    }
    fn describe(&self) -> String {
        "huge examples".into()
    }
}

/// Batches that cannot fit the memory the process can allocate are refused when the
/// loader is made, before any example is read (two 12000x12000 images in batches of 32
/// asked for 18 GB and aborted the process).
#[test]
fn batches_beyond_the_memory_budget_are_refused_before_any_is_made() {
    let options = LoaderOptions {
        batch_size: 32,
        workers: 0,
        ..LoaderOptions::default()
    };
    let err = Loader::new(Arc::new(Huge([1, 1 << 20, 1 << 20])), options)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("huge examples")
            && err.contains("batches of 2 examples")
            && err.contains("MiB available"),
        "{err}"
    );
}
