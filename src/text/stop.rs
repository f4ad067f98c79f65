//! Stop strings: text is held back while it could still be the start of a stop string,
//! and a stop string that appears ends the text just before it (it is not returned, as
//! in the OpenAI API).

#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// What the matcher lets out after new text.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    pub text: String,
    /// A stop string was found: the text ends here.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Feed new text; returns the text that can safely be shown.
    pub fn push(&mut self, text: &str) -> Released {
        if self.stops.is_empty() {
            return Released {
                text: text.to_string(),
                stopped: false,
            };
        }
        self.pending.push_str(text);
        // The earliest stop string in what is pending.
        if let Some(pos) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let out = self.pending[..pos].to_string();
            self.pending.clear();
            return Released {
                text: out,
                stopped: true,
            };
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let hold = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        let out = self.pending[..hold].to_string();
        self.pending.drain(..hold);
        Released {
            text: out,
            stopped: false,
        }
    }

    /// The held-back text, at the end of a generation that did not stop on a string.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_split_over_pieces_is_found_and_cut() {
        assert_eq!(
            run(&["\n\n"], &["Hello", "\n", "\nWorld"]),
            ("Hello".into(), true)
        );
        assert_eq!(
            run(&["END", "xyz"], &["abc E", "N", "D tail"]),
            ("abc ".into(), true)
        );
    }

    #[test]
    fn partial_match_that_fails_is_released() {
        let stops = vec!["END".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("ab E").text, "ab ");
        assert_eq!(m.push("N").text, "");
        let r = m.push("x");
        assert_eq!(r.text, "ENx");
        assert!(!r.stopped);
        assert_eq!(run(&["END"], &["ab", "EN"]), ("abEN".into(), false));
    }

    #[test]
    fn earliest_stop_wins_and_unicode_is_safe() {
        assert_eq!(
            run(&["b", "a"], &["xxab"]),
            ("xx".into(), true),
            "earliest position, not first in the list"
        );
        assert_eq!(run(&["é!"], &["café", "é", "!"]), ("café".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }
}
