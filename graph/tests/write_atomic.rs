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
