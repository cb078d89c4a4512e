//! Progress of an export or import on stderr, per table: a bar with rows
//! and bytes on a terminal, one line per finished table otherwise (a log
//! file or CI output should not fill with bar redraws).

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};

pub struct Progress {
    terminal: bool,
    verb: &'static str,
}

/// One table under way.
pub struct TableProgress {
    name: &'static str,
    verb: &'static str,
    bar: Option<ProgressBar>,
    rows: u64,
    bytes: u64,
    started: Instant,
}

impl Progress {
    pub fn new(verb: &'static str) -> Progress {
        Progress {
            terminal: std::io::stderr().is_terminal(),
            verb,
        }
    }

    /// Starts a table of `total` rows (0 when unknown).
    pub fn table(&self, name: &'static str, total: u64) -> TableProgress {
        let bar = self.terminal.then(|| {
            // An import does not know a table's size before reading it: a
            // spinner with the count then, a bar when the total is known.
            let (bar, template) = if total == 0 {
                (
                    ProgressBar::new_spinner(),
                    "{prefix:>18} {spinner} {human_pos} rows {msg} {elapsed}",
                )
            } else {
                (
                    ProgressBar::new(total),
                    "{prefix:>18} [{bar:30}] {human_pos}/{human_len} rows {msg} {elapsed}",
                )
            };
            let style = ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            bar.set_style(style);
            bar.set_prefix(name);
            bar
        });
        TableProgress {
            name,
            verb: self.verb,
            bar,
            rows: 0,
            bytes: 0,
            started: Instant::now(),
        }
    }
}

impl TableProgress {
    pub fn row(&mut self, bytes: usize) {
        self.rows += 1;
        self.bytes += bytes as u64;
        if let Some(bar) = &self.bar {
            // Redrawing is rate-limited by indicatif; the message is cheap.
            if self.rows % 256 == 0 {
                bar.set_message(indicatif::HumanBytes(self.bytes).to_string());
            }
            bar.inc(1);
        }
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn finish(self) {
        match self.bar {
            Some(bar) => {
                bar.set_message(indicatif::HumanBytes(self.bytes).to_string());
                bar.finish();
            }
            None => eprintln!(
                "{} {}: {} rows, {} bytes, {:.2} s",
                self.verb,
                self.name,
                self.rows,
                self.bytes,
                self.started.elapsed().as_secs_f64()
            ),
        }
    }
}
