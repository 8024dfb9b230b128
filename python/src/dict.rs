//! Rust structs' fields handed to Python as dicts.

/// A new `PyDict` holding the named fields of `$src`, each under its own name, in the order
/// given; a failed conversion returns its error from the calling function (`?`).
macro_rules! fields_dict {
    ($py:expr, $src:ident; $($field:ident),* $(,)?) => {{
        let d = pyo3::types::PyDict::new($py);
        $crate::dict::set_fields!(d, $src; $($field),*);
        d
    }};
}

/// Sets the named fields of `$src` in dict `$d`, each under its own name, in the order
/// given; a failed conversion returns its error from the calling function (`?`).
macro_rules! set_fields {
    ($d:ident, $src:ident; $($field:ident),* $(,)?) => {
        $($d.set_item(stringify!($field), $src.$field)?;)*
    };
}

pub(crate) use {fields_dict, set_fields};
