//! The bindings' layouts against what a C compiler makes of the uapi header: every struct's
//! size and every field's offset, and every command number. (bindgen's own compile-time
//! assertions check the bindings against themselves; this checks them against C.)

use std::mem::{offset_of, size_of};
use std::process::Command;
use uvm_ioctl::bindings::*;

const HEADER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../driver-patch/include/uvm_vmem_ioctl.h"
);

macro_rules! layout {
    ($ty:ident { $($field:ident),* }) => {
        vec![
            (format!("sizeof {}", stringify!($ty)), size_of::<$ty>()),
            $((format!("{}.{}", stringify!($ty), stringify!($field)), offset_of!($ty, $field)),)*
        ]
    };
}

/// Command numbers, each under its own name: `("UVM_VMEM_QUERY", UVM_VMEM_QUERY)`, ...
macro_rules! numbers {
    ($($name:ident),* $(,)?) => {
        vec![$((stringify!($name).to_string(), $name as usize),)*]
    };
}

#[test]
fn struct_layouts_and_numbers_match_the_c_compiler() {
    let rust: Vec<(String, usize)> = [
        layout!(UVM_VMEM_QUERY_PARAMS {
            pageSizes,
            rangeAlign,
            version,
            rmStatus
        }),
        layout!(UVM_VMEM_RESERVE_PARAMS {
            gpuUuid,
            length,
            base,
            flags,
            rmStatus
        }),
        layout!(UVM_VMEM_CREATE_PARAMS {
            gpuUuid,
            pageSize,
            handle,
            flags,
            rmStatus
        }),
        layout!(UVM_VMEM_MAP_PARAMS {
            base,
            handle,
            mapCount,
            flags,
            rmStatus
        }),
        layout!(UVM_VMEM_UNMAP_PARAMS {
            base,
            length,
            unmapped,
            flags,
            rmStatus
        }),
        layout!(UVM_VMEM_RELEASE_PARAMS {
            handle,
            flags,
            rmStatus
        }),
        layout!(UVM_VMEM_FREE_PARAMS {
            base,
            flags,
            rmStatus
        }),
        layout!(UVM_VMEM_BATCH_ENTRY { base, handle }),
        layout!(UVM_VMEM_BATCH_PARAMS {
            entries,
            count,
            flags,
            done,
            rmStatus
        }),
        layout!(UVM_VMEM_SELF_TEST_PARAMS {
            flags,
            failedStep,
            rmStatus
        }),
        numbers!(
            UVM_VMEM_QUERY,
            UVM_VMEM_RESERVE,
            UVM_VMEM_CREATE,
            UVM_VMEM_MAP,
            UVM_VMEM_UNMAP,
            UVM_VMEM_RELEASE,
            UVM_VMEM_FREE,
            UVM_VMEM_MAP_BATCH,
            UVM_VMEM_UNMAP_BATCH,
            UVM_VMEM_SELF_TEST,
            UVM_VMEM_VERSION,
            UVM_VMEM_PAGE_SIZES,
        ),
    ]
    .concat();

    // The same list, printed by a C program.
    let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n");
    c += &format!("#include \"{HEADER}\"\nint main(void) {{\n");
    for (name, _) in &rust {
        let expr = if let Some(ty) = name.strip_prefix("sizeof ") {
            format!("sizeof({ty})")
        } else if let Some((ty, field)) = name.split_once('.') {
            format!("offsetof({ty}, {field})")
        } else {
            format!("(size_t)({name})")
        };
        c += &format!("    printf(\"%s %zu\\n\", \"{name}\", (size_t)({expr}));\n");
    }
    c += "    return 0;\n}\n";
    let dir = std::env::temp_dir().join(format!("uvm-ioctl-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("layout.c"), c).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-o"])
        .arg(dir.join("layout"))
        .arg(dir.join("layout.c"))
        .status()
        .unwrap_or_else(|e| panic!("running {cc}: {e} (a C compiler is needed for this test)"));
    assert!(status.success(), "the uapi header does not compile as C");
    let out = Command::new(dir.join("layout")).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let c_values: Vec<(String, usize)> = text
        .lines()
        .map(|l| {
            let (n, v) = l.rsplit_once(' ').unwrap();
            (n.to_string(), v.parse().unwrap())
        })
        .collect();
    assert_eq!(c_values, rust);
    std::fs::remove_dir_all(&dir).unwrap();
}
