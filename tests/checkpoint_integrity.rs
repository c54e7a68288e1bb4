//! Checkpoints that cannot lie (issue 25): checksums per variable and per file,
//! non-finite values refused on restore, and saves that keep the previous checkpoint
//! and leave nothing behind when they fail. CPU only.

mod common;

use std::path::Path;

use ampgraph::checkpoint::LIBRARY_PREFIX;
use ampgraph::graph::format::previous_path;
use ampgraph::graph::{DType, Tensor};
use ampgraph::session::SessionError;
use ampgraph::train::EPOCH_VARIABLE;
use ampgraph::{Device, RestoreOptions, Session, SessionOptions};
use common::{small_training_graph, ScratchDir};

/// A CPU session of [`small_training_graph`].
fn session() -> Session {
    session_seeded(0)
}

fn session_seeded(seed: u64) -> Session {
    let options = SessionOptions {
        seed,
        ..Default::default()
    };
    Session::with_options(small_training_graph(), Device::Cpu, options).unwrap()
}

/// Every variable's name and value, sorted by name.
fn variables(s: &Session) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = s
        .graph()
        .node_ids()
        .map(|id| s.graph().node(id).name.clone())
        .filter_map(|n| s.variable(&n).map(|t| (n.clone(), t.clone())))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The little-endian bytes a checkpoint stores for `t` (f32 and i64 here).
fn le_bytes(t: &Tensor) -> Vec<u8> {
    match t.dtype() {
        DType::F32 => t
            .to_f64_vec()
            .iter()
            .flat_map(|&v| (v as f32).to_le_bytes())
            .collect(),
        DType::I64 => t
            .to_f64_vec()
            .iter()
            .flat_map(|&v| (v as i64).to_le_bytes())
            .collect(),
        other => panic!("no variable of type {other} in this model"),
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn checkpoint_message(err: SessionError) -> String {
    assert!(matches!(err, SessionError::Checkpoint { .. }), "{err}");
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "one line: {msg}");
    msg
}

fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect()
}

#[test]
fn a_flipped_bit_in_a_variable_is_refused_naming_it() {
    let dir = ScratchDir::new("ckpt-flip_var");
    let s = session();
    let path = dir.join("m.ckpt");
    s.save(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let before = variables(&s);
    let mut target = session_seeded(1);
    let mut checked = 0;
    for (name, t) in &before {
        let data = le_bytes(t);
        // The entry starts with the name (a one-byte length, then the bytes); its data
        // is the first run of its bytes after that (zeros included: a shape and a
        // non-zero length come between).
        let mut key = vec![u8::try_from(name.len()).unwrap()];
        key.extend_from_slice(name.as_bytes());
        let entry = find(&good, &key).unwrap_or_else(|| panic!("'{name}' is in the file"));
        let at = entry + find(&good[entry..], &data).expect("its data follows its name");
        // The first, a middle and the last byte of the variable's data, each bit once
        // over the three.
        for (k, offset) in [0, data.len() / 2, data.len() - 1].into_iter().enumerate() {
            for bit in [k, k + 3, 7 - k] {
                let mut bad = good.clone();
                bad[at + offset] ^= 1 << bit;
                let corrupt = dir.join("corrupt.ckpt");
                std::fs::write(&corrupt, &bad).unwrap();
                let msg = checkpoint_message(target.restore(&corrupt).unwrap_err());
                assert!(
                    msg.contains(&format!("variable '{name}' is corrupt (checksum mismatch)")),
                    "byte {} bit {bit}: {msg}",
                    at + offset
                );
                assert!(msg.contains("corrupt.ckpt"), "{msg}");
                checked += 1;
            }
        }
    }
    assert!(
        checked >= 9 * 8,
        "{checked} flips for {} variables",
        before.len()
    );
    // Nothing was restored by the failures; the good file restores.
    assert_ne!(variables(&target), before);
    target.restore(&path).unwrap();
    assert_eq!(variables(&target), before);
}

#[test]
fn a_flipped_bit_anywhere_in_the_file_is_refused_without_panic() {
    let dir = ScratchDir::new("ckpt-flip_any");
    let s = session();
    let path = dir.join("m.ckpt");
    s.save(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let mut target = session();
    let fresh = variables(&target);
    let corrupt = dir.join("corrupt.ckpt");
    // Every byte of the file, a different bit at each, the last byte with every bit.
    let mut flips: Vec<(usize, u32)> = (0..good.len()).map(|i| (i, (i % 8) as u32)).collect();
    flips.extend((0..8).map(|bit| (good.len() - 1, bit)));
    for (i, bit) in flips {
        let mut bad = good.clone();
        bad[i] ^= 1 << bit;
        std::fs::write(&corrupt, &bad).unwrap();
        let err = target
            .restore(&corrupt)
            .expect_err(&format!("byte {i} bit {bit} flipped must be refused"));
        checkpoint_message(err);
    }
    // The last bytes are the whole-file checksum.
    let mut bad = good.clone();
    *bad.last_mut().unwrap() ^= 0x80;
    std::fs::write(&corrupt, &bad).unwrap();
    let msg = checkpoint_message(target.restore(&corrupt).unwrap_err());
    assert!(
        msg.contains("the file is corrupt (checksum mismatch)"),
        "{msg}"
    );
    assert_eq!(
        variables(&target),
        fresh,
        "no failed restore changed anything"
    );
}

#[test]
fn a_truncated_checkpoint_is_a_clear_error() {
    let dir = ScratchDir::new("ckpt-truncated");
    let s = session();
    let path = dir.join("m.ckpt");
    s.save(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let mut target = session();
    let cut = dir.join("cut.ckpt");
    let mut lengths: Vec<usize> = vec![0, 1, 7, 8, 11, 12, 19, 20, 21, good.len() / 2];
    lengths.extend(good.len() - 8..good.len());
    for len in lengths {
        std::fs::write(&cut, &good[..len]).unwrap();
        let msg = checkpoint_message(target.restore(&cut).unwrap_err());
        let want = if len < 8 { "bad magic" } else { "truncated" };
        assert!(msg.contains(want), "{len} bytes: {msg}");
    }
}

#[test]
fn an_old_format_version_is_refused_saying_so() {
    let dir = ScratchDir::new("ckpt-old_version");
    let s = session();
    let path = dir.join("m.ckpt");
    s.save(&path).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let msg = checkpoint_message(session().restore(&path).unwrap_err());
    assert!(
        msg.contains("format version 1") && msg.contains("older") && msg.contains("version 2"),
        "{msg}"
    );
}

#[test]
fn non_finite_weights_are_refused_unless_allowed() {
    let dir = ScratchDir::new("ckpt-non_finite");
    for (poison, label) in [(f64::NAN, "nan"), (f64::INFINITY, "inf")] {
        let mut s = session();
        let (name, t) = variables(&s)
            .into_iter()
            .find(|(n, t)| n.ends_with("kernel") && t.dtype() == DType::F32 && t.len() > 3)
            .expect("a dense kernel");
        let mut values = t.to_f64_vec();
        values[3] = poison;
        let poisoned = Tensor::from_f64(DType::F32, t.shape().to_vec(), &values).unwrap();
        s.set_variable(&name, poisoned).unwrap();
        let path = dir.join(format!("{label}.ckpt"));
        s.save(&path).unwrap();

        let mut target = session();
        let fresh = variables(&target);
        let msg = checkpoint_message(target.restore(&path).unwrap_err());
        assert!(
            msg.contains(&format!("variable '{name}' has 1 non-finite value"))
                && msg.contains("index 3"),
            "{msg}"
        );
        assert_eq!(variables(&target), fresh, "nothing restored");

        target
            .restore_with(
                &path,
                RestoreOptions {
                    allow_non_finite: true,
                    ..RestoreOptions::default()
                },
            )
            .unwrap();
        let got = target.variable(&name).unwrap().to_f64_vec();
        assert!(!got[3].is_finite(), "{label}: {}", got[3]);
        assert_eq!(got[3].is_nan(), poison.is_nan());
        assert_eq!(got[..3], values[..3]);
    }
}

#[test]
fn a_second_save_keeps_the_first_as_prev() {
    let dir = ScratchDir::new("ckpt-prev");
    let mut s = session();
    let path = dir.join("m.ckpt");
    let prev = dir.join("m.ckpt.prev");
    s.save(&path).unwrap();
    assert!(!prev.exists(), "no previous checkpoint on the first save");
    let first = std::fs::read(&path).unwrap();
    let first_vars = variables(&s);

    let (name, t) = first_vars[0].clone();
    let changed: Vec<f64> = t.to_f64_vec().iter().map(|v| v + 1.0).collect();
    s.set_variable(
        &name,
        Tensor::from_f64(t.dtype(), t.shape().to_vec(), &changed).unwrap(),
    )
    .unwrap();
    s.save(&path).unwrap();
    assert_eq!(std::fs::read(&prev).unwrap(), first);
    assert_ne!(std::fs::read(&path).unwrap(), first);
    assert!(temporaries(&dir).is_empty(), "{:?}", temporaries(&dir));

    let mut target = session();
    target.restore(&prev).unwrap();
    assert_eq!(variables(&target), first_vars);
    target.restore(&path).unwrap();
    assert_eq!(variables(&target), variables(&s));
}

#[test]
fn a_failed_save_keeps_the_previous_checkpoint_and_no_temporary() {
    let dir = ScratchDir::new("ckpt-failed_save");
    let mut s = session();
    let path = dir.join("m.ckpt");
    s.save(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let (name, t) = variables(&s)[0].clone();
    let changed: Vec<f64> = t.to_f64_vec().iter().map(|v| v * 2.0 + 1.0).collect();
    s.set_variable(
        &name,
        Tensor::from_f64(t.dtype(), t.shape().to_vec(), &changed).unwrap(),
    )
    .unwrap();

    // Fails after the temporary is written: PATH.prev cannot be replaced (a
    // non-empty directory is in its place).
    let blocker = dir.join("m.ckpt.prev");
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("keep"), b"x").unwrap();
    let err = s.save(&path).unwrap_err();
    assert!(err.to_string().contains("m.ckpt"), "{err}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        good,
        "the old checkpoint is intact"
    );
    assert!(temporaries(&dir).is_empty(), "{:?}", temporaries(&dir));
    session().restore(&path).unwrap();
    std::fs::remove_dir_all(&blocker).unwrap();

    // Fails creating the temporary: the checkpoint's name is as long as a name may be,
    // so its temporary's (the name and a suffix) is too long.
    let long = dir.join("m".repeat(250));
    std::fs::write(&long, &good).unwrap();
    assert!(s.save(&long).is_err());
    assert_eq!(
        std::fs::read(&long).unwrap(),
        good,
        "the old checkpoint is intact"
    );
    assert!(!previous_path(&long).exists());
    assert!(temporaries(&dir).is_empty(), "{:?}", temporaries(&dir));
    std::fs::remove_file(&long).unwrap();

    // A read-only directory (where permissions bind: not as root).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        let probe = dir.join("probe");
        let binding = std::fs::write(&probe, b"x").is_err();
        let _ = std::fs::remove_file(&probe);
        if binding {
            assert!(s.save(&path).is_err());
            assert_eq!(std::fs::read(&path).unwrap(), good);
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(temporaries(&dir).is_empty(), "{:?}", temporaries(&dir));
    }

    // With nothing in the way the save goes through, and the old one becomes .prev.
    s.save(&path).unwrap();
    assert_eq!(std::fs::read(dir.join("m.ckpt.prev")).unwrap(), good);
    assert!(temporaries(&dir).is_empty(), "{:?}", temporaries(&dir));
}

/// A training graph's session skips a checkpoint's variables under the library's
/// prefix that it lacks (a trainer's position) and refuses any other it lacks; with
/// no prefix to skip it refuses those too.
#[test]
fn unknown_variables_are_refused_unless_under_a_skipped_prefix() {
    let dir = ScratchDir::new("ckpt-unknown");
    let save_with = |extra: &str| {
        let path = dir.join(format!("{}.ckpt", extra.replace('/', "_")));
        let mut source = session();
        let position = Tensor::from_f64(DType::I64, vec![], &[3.0]).unwrap();
        source.executor_mut().set_variable(extra, position).unwrap();
        source.save(&path).unwrap();
        path
    };
    assert!(EPOCH_VARIABLE.starts_with(LIBRARY_PREFIX));
    let trainers = save_with(EPOCH_VARIABLE);
    let mut target = session();
    target.restore(&trainers).unwrap();
    assert!(target.variable("ampgraph/trainer/epoch").is_none());
    let strict = RestoreOptions {
        skip_unknown: vec![],
        ..RestoreOptions::default()
    };
    let msg = checkpoint_message(target.restore_with(&trainers, strict).unwrap_err());
    assert!(
        msg.contains("variable 'ampgraph/trainer/epoch' is not in the graph"),
        "{msg}"
    );
    let stray = save_with("stray");
    let msg = checkpoint_message(target.restore(&stray).unwrap_err());
    assert!(
        msg.contains("variable 'stray' is not in the graph"),
        "{msg}"
    );
}

/// Checkpoints whose checksums are valid but whose contents cannot be a run's are
/// refused: a variable stored twice (the last one won), a loss scale that is not
/// positive and finite (-1 trained). A refused checkpoint's error points at `FILE.prev`
/// where one exists.
#[test]
fn forged_checkpoints_with_valid_checksums_are_refused() {
    use ampgraph::checkpoint;
    use ampgraph::optim::LOSS_SCALE_VARIABLE;
    let dir = ScratchDir::new("ckpt-forged");
    let path = dir.join("forged.ckpt");
    let good = variables(&session());
    let scalar = |v: f64| Tensor::from_f64(DType::F32, vec![], &[v]).unwrap();

    let mut twice = good.clone();
    twice.push(good[0].clone());
    checkpoint::write(&path, &twice).unwrap();
    let msg = checkpoint_message(session().restore(&path).unwrap_err());
    assert!(
        msg.contains(&format!("variable '{}' is stored twice", good[0].0)),
        "{msg}"
    );
    // The write kept the good one before it as FILE.prev: the error says so.
    let prev = previous_path(&path);
    assert!(!prev.exists(), "no earlier checkpoint yet");

    for bad in [-1.0, 0.0, f64::INFINITY] {
        let mut forged: Vec<(String, Tensor)> = good.clone();
        forged.retain(|(n, _)| n != LOSS_SCALE_VARIABLE);
        forged.push((LOSS_SCALE_VARIABLE.to_string(), scalar(bad)));
        checkpoint::write(&path, &forged).unwrap();
        let options = RestoreOptions {
            allow_non_finite: true,
            ..RestoreOptions::default()
        };
        let msg = checkpoint_message(session().restore_with(&path, options).unwrap_err());
        assert!(
            msg.contains(&format!("variable '{LOSS_SCALE_VARIABLE}' is {bad}"))
                && msg.contains("positive and finite"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!(
                "{} holds the checkpoint saved before it",
                prev.display()
            )),
            "{msg}"
        );
    }
}
