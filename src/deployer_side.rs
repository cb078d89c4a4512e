//! The deployer's side of the protocol (deployer.md), shared by the
//! deployers built into this binary (`local`, `nix`): read the request on
//! stdin, run the verb, write the result to `BERTH_RESULT` atomically. Why a module: both
//! must bound the request, refuse a non-JSON one and never leave a torn
//! result file, the same way.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The request on stdin at most.
const MAX_REQUEST_BYTES: u64 = 4 << 20;

/// One call of a built-in deployer: reads the request, runs `call` with the
/// verb and the request, writes the result it returns (if any) and returns
/// its exit status. `call` answers `None` for a verb it does not know.
pub fn run(
    deployer: &str,
    verb: &str,
    call: impl FnOnce(&str, &Value) -> Option<(Option<Value>, i32)>,
) -> i32 {
    let (result_path, request) = match read_request(deployer) {
        Ok(r) => r,
        Err(code) => return code,
    };
    let Some((result, code)) = call(verb, &request) else {
        eprintln!("unknown verb {verb:?}; expected describe, eval, deploy or destroy");
        return 2;
    };
    if let Some(result) = result {
        if let Err(e) = write_atomically(&result_path, result.to_string().as_bytes()) {
            eprintln!("cannot write the result: {e}");
            return 2;
        }
    }
    code
}

/// `BERTH_RESULT` and the request, or the exit status to leave with (after
/// saying why on stderr).
fn read_request(deployer: &str) -> Result<(PathBuf, Value), i32> {
    let Some(result_path) = std::env::var_os("BERTH_RESULT").map(PathBuf::from) else {
        eprintln!(
            "berth deployer {deployer}: BERTH_RESULT is not set; this command is run by `berth serve`"
        );
        return Err(2);
    };
    let mut input = String::new();
    if let Err(e) = std::io::stdin()
        .take(MAX_REQUEST_BYTES)
        .read_to_string(&mut input)
    {
        eprintln!("cannot read the request on stdin: {e}");
        return Err(2);
    }
    match serde_json::from_str(&input) {
        Ok(request) => Ok((result_path, request)),
        Err(e) => {
            eprintln!("the request on stdin is not JSON: {e}");
            Err(2)
        }
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, both
/// made durable: berth never reads a half-written result or state.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    crate::durable::replace(path, bytes, 0o600)
}
