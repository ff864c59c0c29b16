//! A unit test's own directory, removed when dropped, also when the test fails.

use std::{
    fs,
    ops::Deref,
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
};

pub struct TestDir(PathBuf);

impl TestDir {
    /// `sluice-{name}-{pid}-{n}` in the system's temporary directory, `n` counting this
    /// process's directories (tests run in parallel), emptied first: what a killed run left
    /// there is not read back.
    pub fn new(name: &str) -> TestDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "sluice-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TestDir(dir)
    }
}

impl Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
