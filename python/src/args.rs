//! Python values to Rust ones: ints, counts and token ids, each refused with
//! `InvalidArgument` naming the argument (never `TypeError` or `OverflowError`).

use crate::InvalidArgument;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyList};

/// Whether `v` is a Python int and not a bool.
pub(crate) fn is_int(v: &Bound<'_, PyAny>) -> bool {
    v.is_instance_of::<PyInt>() && !v.is_instance_of::<PyBool>()
}

/// A Python int as a `u64`: anything else (a bool, a float, a negative int, an int past 64
/// bits) is `InvalidArgument` naming the argument, never `TypeError` or `OverflowError`.
pub(crate) fn to_u64(v: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if !is_int(v) {
        let shown = v.repr().map(|r| r.to_string()).unwrap_or_default();
        return Err(InvalidArgument::new_err(format!(
            "{name} must be an int, got {shown}"
        )));
    }
    v.extract::<u64>().or_else(|_| {
        let shown = v.str().map(|r| r.to_string()).unwrap_or_default();
        Err(if v.lt(0)? {
            InvalidArgument::new_err(format!("{name} must be >= 0, got {shown}"))
        } else {
            InvalidArgument::new_err(format!("{name} = {shown} is too large (at most 2**64 - 1)"))
        })
    })
}

/// Token ids from a Python sequence of ints (a list, a tuple, or anything iterable the
/// Python side turned into a list): each must be an int in `0..2**32`; anything else is
/// `InvalidArgument` naming its position.
pub(crate) fn token_ids(v: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let seq = v.cast::<PyList>().map_err(|_| {
        InvalidArgument::new_err("tokens must be a list of token ids (ints)".to_string())
    })?;
    seq.iter()
        .enumerate()
        .map(|(i, t)| {
            // The message is built only for a bad id: a 100k-token prompt would otherwise
            // format one name per token.
            if t.is_exact_instance_of::<PyInt>() {
                if let Ok(x) = t.extract::<u32>() {
                    return Ok(x);
                }
                if !t.lt(0)? {
                    // Past 32 bits, however far: not "too large for 64 bits".
                    let mut shown = t.str()?.to_string();
                    if shown.len() > 40 {
                        shown.truncate(37);
                        shown.push_str("...");
                    }
                    return Err(InvalidArgument::new_err(format!(
                        "tokens[{i}] = {shown} is not a token id (< 2**32)"
                    )));
                }
            }
            let x = to_u64(&t, &format!("tokens[{i}]"))?;
            Err(InvalidArgument::new_err(format!(
                "tokens[{i}] = {x} is not a token id (< 2**32)"
            )))
        })
        .collect()
}

/// As [`to_u64`], for counts and indices.
pub(crate) fn to_usize(v: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let x = to_u64(v, name)?;
    usize::try_from(x).map_err(|_| InvalidArgument::new_err(format!("{name} = {x} is too large")))
}
