//! The image-folder example as a user meets it: on its synthetic folder it trains the
//! convnet (the loss falls, evaluation runs), and a folder with an image of another
//! size stops it with one line naming the file. On the CPU.

mod common;

use std::process::{Command, Output};

use common::example_binary;

fn run(args: &[&str]) -> Output {
    Command::new(example_binary("image_folder"))
        .args(["--device", "cpu", "--quiet", "--width", "4"])
        .args(args)
        .output()
        .expect("the image_folder example runs")
}

#[test]
fn it_trains_on_its_synthetic_folder() {
    let out = run(&[
        "--epochs",
        "2",
        "--seed",
        "4242",
        "--batch",
        "32",
        "--initial-loss-scale",
        "512",
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let losses: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("epoch "))
        .map(|l| {
            // The scale started at 512 and this small convnet does not overflow.
            assert!(
                l.contains("loss scale 512,")
                    && l.contains("eval loss")
                    && l.contains("eval accuracy"),
                "{l}"
            );
            let loss = l.split("loss ").nth(1).unwrap().split(',').next().unwrap();
            loss.parse().unwrap()
        })
        .collect();
    assert_eq!(losses.len(), 2, "{text}");
    assert!(losses[1] < losses[0], "{losses:?}");
}

#[test]
fn a_loss_scale_that_is_not_a_positive_number_is_refused() {
    for bad in ["0", "inf", "NaN"] {
        let out = run(&["--initial-loss-scale", bad]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.starts_with("error: ") && stderr.contains("not a finite number above 0"),
            "{stderr}"
        );
    }
}

#[test]
fn an_image_of_another_size_is_one_line_naming_it() {
    let root = std::env::temp_dir().join(format!("ampgraph-folder-bad-{}", std::process::id()));
    for (class, name, size) in [("a", "1.png", 8), ("a", "2.png", 8), ("b", "3.png", 9)] {
        std::fs::create_dir_all(root.join(class)).unwrap();
        let pixels = vec![128u8; size * size];
        let path = root.join(class).join(name);
        image::save_buffer(
            &path,
            &pixels,
            size as u32,
            size as u32,
            image::ExtendedColorType::L8,
        )
        .unwrap();
    }
    let out = run(&[
        "--data",
        root.to_str().unwrap(),
        "--batch",
        "3",
        "--epochs",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains("3.png"),
        "{stderr}"
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// A folder without class folders says what it looked for (it said "no MNIST files
/// found").
#[test]
fn a_folder_without_classes_says_what_it_looked_for() {
    let root = std::env::temp_dir().join(format!("ampgraph-folder-empty-{}", std::process::id()));
    std::fs::create_dir_all(&root).unwrap();
    let out = run(&["--data", root.to_str().unwrap(), "--epochs", "1"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "no image folder found (looked for class folders holding PNG or JPEG images)"
        ),
        "{stderr}"
    );
    std::fs::remove_dir_all(root).unwrap();
}
