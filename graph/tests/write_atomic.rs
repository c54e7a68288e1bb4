//! `format::write_atomic` from several threads at once: each write renames a whole
//! file of its own (executors in threads keep cuDNN's chosen algorithms in one file;
//! a temporary shared by the threads of a process once interleaved their contents into
//! lines that matched no write, and the next process ran a convolution with another's
//! algorithm).

use ampgraph_graph::format::write_atomic;

#[test]
fn concurrent_writes_of_one_file_each_leave_a_whole_file() {
    let dir = std::env::temp_dir().join(format!("ampgraph_write_atomic_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("algorithms.txt");
    // Contents of different lengths: an interleaving shows as a mix of two of them.
    let contents: Vec<Vec<u8>> = (0..8)
        .map(|t| format!("writer {t}\n").repeat(2000 + 700 * t).into_bytes())
        .collect();
    let (all, path) = (&contents, &path);
    std::thread::scope(|s| {
        for c in all {
            s.spawn(move || {
                for _ in 0..20 {
                    write_atomic(path, c).unwrap();
                    let now = std::fs::read(path).unwrap();
                    assert!(all.contains(&now), "a mixed file of {} bytes", now.len());
                }
            });
        }
    });
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "algorithms.txt")
        .collect();
    assert!(left.is_empty(), "temporaries left: {left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A write removes the temporaries earlier writes of the same file left when their
/// process was killed before the rename (`kill -9` during `rewrite -o`), and keeps
/// those of running processes and other files.
#[cfg(target_os = "linux")]
#[test]
fn a_write_removes_the_temporaries_of_dead_writers() {
    let dir = std::env::temp_dir().join(format!("ampgraph_stale_tmp_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.onnx");
    // No process has a pid this large (Linux's pid_max is at most 2^22).
    let dead = 4_194_305 + 17;
    let mine = std::process::id();
    let files = [
        (format!("model.onnx.tmp{dead}.0"), false),
        (format!("model.onnx.prev.tmp{dead}.3"), false),
        (format!("model.onnx.tmp{mine}.999"), true),
        (format!("other.onnx.tmp{dead}.0"), true),
        (format!("model.onnx2.tmp{dead}.0"), true),
        ("model.onnx.tmpnotes".to_string(), true),
    ];
    for (name, _) in &files {
        std::fs::write(dir.join(name), b"partial").unwrap();
    }
    write_atomic(&path, b"whole").unwrap();
    for (name, kept) in &files {
        assert_eq!(dir.join(name).exists(), *kept, "{name}");
    }
    assert_eq!(std::fs::read(&path).unwrap(), b"whole");
    std::fs::remove_dir_all(&dir).unwrap();
}
