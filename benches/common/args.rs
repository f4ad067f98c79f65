//! The positional arguments of a bench (`cargo bench --bench NAME -- A B C`), without the
//! `--bench` flag cargo adds.

pub struct Args(Vec<String>);

impl Args {
    pub fn new() -> Self {
        Args(
            std::env::args()
                .skip(1)
                .filter(|a| a != "--bench")
                .collect(),
        )
    }

    /// Argument `i` as a number, `default` when it is missing or not one.
    pub fn num(&self, i: usize, default: usize) -> usize {
        self.0
            .get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    }

    /// Argument `i` as given, if present.
    #[allow(dead_code)] // (not every bench takes a word)
    pub fn word(&self, i: usize) -> Option<&str> {
        self.0.get(i).map(String::as_str)
    }
}
