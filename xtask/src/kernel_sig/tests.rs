use super::*;

fn types(k: &KernelSig) -> Vec<ParamType> {
    k.params.iter().map(|p| p.ty).collect()
}

fn err(src: &str) -> String {
    format!("{:#}", parse_kernels("t.cu", src).unwrap_err())
}

#[test]
fn parses_multi_line_params_with_qualifiers_and_comments() {
    let src = r#"
#include "common.cuh"
#define BLOCK 256 // a __global__ in a macro line is not a kernel
/* __global__ in a block comment
   is not one either */
extern "C" __global__ void rms_norm_f32w(
    const float* __restrict__ x,   // input rows
    const float * w, /* weights */ float *out,
    int rows, int dim,
    float eps, float offset) {
  // body with a string "__global__" and braces { }
}
"#;
    let ks = parse_kernels("dense.cu", src).unwrap();
    assert_eq!(ks.len(), 1);
    let k = &ks[0];
    assert_eq!(k.name, "rms_norm_f32w");
    assert_eq!(k.line, 6);
    use ParamType::*;
    assert_eq!(types(k), [Ptr, Ptr, Ptr, I32, I32, F32, F32]);
    assert_eq!(
        k.display(),
        "rms_norm_f32w(const float* __restrict__ x, const float* w, float* out, \
         int rows, int dim, float eps, float offset)"
    );
    assert_eq!(k.params[2].name, "out");
}

#[test]
fn maps_every_supported_scalar_and_any_pointer() {
    let src = r#"extern "C" __global__ void all(int a, int32_t b, unsigned c,
        unsigned int d, uint32_t e, float f, long long g, int64_t h,
        unsigned long long i, uint64_t j, const unsigned short* k,
        void* l, const __nv_bfloat16 *__restrict__ m, float** n, const int o) {}"#;
    let ks = parse_kernels("t.cu", src).unwrap();
    use ParamType::*;
    assert_eq!(
        types(&ks[0]),
        [
            I32, I32, U32, U32, U32, F32, I64, I64, U64, U64, Ptr, Ptr, Ptr, Ptr, I32
        ]
    );
    let rust: Vec<&str> = ks[0].params.iter().map(|p| p.ty.rust()).collect();
    assert_eq!(rust[..6], ["i32", "i32", "u32", "u32", "u32", "f32"]);
    assert_eq!(map_scalar("double"), None);
    assert_eq!(map_scalar("long"), None);
}

#[test]
fn keeps_order_launch_bounds_empty_lists_and_prototypes() {
    let src = r#"
extern "C" __global__ void b(float* x);
extern "C" __device__ float helper(float x) { return x; }
extern "C" __global__ void __launch_bounds__(256, 2) a(void) {}
extern "C" __global__ void c() {}
extern "C" __global__ void b(float* y) {}
"#;
    let ks = parse_kernels("t.cu", src).unwrap();
    let names: Vec<&str> = ks.iter().map(|k| k.name.as_str()).collect();
    assert_eq!(names, ["b", "a", "c"]);
    assert!(ks[1].params.is_empty() && ks[2].params.is_empty());
    assert_eq!(ks[0].params.len(), 1);
}

#[test]
fn a_file_without_kernels_gives_none() {
    assert!(
        parse_kernels("t.cuh", "__device__ int f() { return 1; }")
            .unwrap()
            .is_empty()
    );
}

#[test]
fn unsupported_type_names_file_kernel_and_parameter() {
    let e = err("extern \"C\" __global__ void k(float* x,\n  double scale) {}");
    assert!(e.contains("t.cu:1"), "{e}");
    assert!(e.contains("kernel `k`"), "{e}");
    assert!(e.contains("parameter 2"), "{e}");
    assert!(e.contains("`double scale`"), "{e}");
    assert!(e.contains("unsupported type `double`"), "{e}");
    assert!(err("extern \"C\" __global__ void k(size_t n) {}").contains("`size_t`"));
    assert!(err("extern \"C\" __global__ void k(long n) {}").contains("`long`"));
}

#[test]
fn malformed_declarations_are_errors_naming_them() {
    // No extern "C": the name would be mangled.
    let e = err("\n__global__ void k(float* x) {}");
    assert!(e.contains("t.cu:2") && e.contains("extern \"C\""), "{e}");
    // Wrong order / return type.
    assert!(err("extern \"C\" __global__ int k(float* x) {}").contains("return `void`"));
    // Unclosed parameter list.
    let e = err("extern \"C\" __global__ void broken(float* x, int n {");
    assert!(
        e.contains("kernel `broken`") && e.contains("unclosed"),
        "{e}"
    );
    // Unnamed parameters, references, arrays, templates.
    let e = err("extern \"C\" __global__ void k(float*, int n) {}");
    assert!(
        e.contains("kernel `k`, parameter 1") && e.contains("no"),
        "{e}"
    );
    assert!(err("extern \"C\" __global__ void k(unsigned int) {}").contains("has no name"));
    assert!(err("extern \"C\" __global__ void k(float& x) {}").contains("`float & x`"));
    assert!(err("extern \"C\" __global__ void k(float x[4]) {}").contains("unsupported"));
    assert!(err("extern \"C\" __global__ void k(int a,) {}").contains("empty parameter"));
    // No name at all.
    assert!(err("extern \"C\" __global__ void (int a) {}").contains("kernel's name"));
}

#[test]
fn redeclaration_with_other_params_is_an_error() {
    let src = "extern \"C\" __global__ void k(float* x);\n\
               extern \"C\" __global__ void k(int x) {}";
    let e = err(src);
    assert!(e.contains("t.cu:2") && e.contains("first at line 1"), "{e}");
}
