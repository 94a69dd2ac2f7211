//! The oracle's dequantisation (`format::quant`) against gguf-py's on committed fixtures
//! (tests/fixtures/make_quant.py): equal bit for bit, block by block, for every block type; and
//! the quantiser's output, as `moe-lanes quantize` wrote it and gguf-py read it back, equal to
//! what moe-lanes computes from the same input.

use moe_lanes::format::dtype::DType;
use moe_lanes::format::quant::{dequantize, quantize};
use std::path::PathBuf;

const TYPES: [(&str, DType); 5] = [
    ("q8_0", DType::Q8_0),
    ("q4_0", DType::Q4_0),
    ("q4_k", DType::Q4_K),
    ("q5_k", DType::Q5_K),
    ("q6_k", DType::Q6_K),
];

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn dequantization_equals_gguf_py_block_by_block() {
    for (name, dtype) in TYPES {
        let blocks = fixture(&format!("{name}.blocks"));
        let expected = floats(&fixture(&format!("{name}.dequant.f32")));
        let (n, bb) = (dtype.block_elems(), dtype.block_bytes());
        assert_eq!(blocks.len() / bb * n, expected.len(), "{name}: fixture sizes");
        for (i, (block, want)) in blocks.chunks_exact(bb).zip(expected.chunks_exact(n)).enumerate() {
            let mut got = vec![0.0f32; n];
            dequantize(dtype, block, &mut got).unwrap();
            let got_bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            let want_bits: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got_bits, want_bits, "{name} block {i}");
        }
    }
}

#[test]
fn quantizer_output_dequantizes_in_gguf_py_to_what_moe_lanes_computes() {
    let input = floats(&fixture("input.f32"));
    for (name, dtype) in TYPES {
        let mut bytes = Vec::new();
        quantize(dtype, &input, &mut bytes).unwrap();
        let mut ours = vec![0.0f32; input.len()];
        dequantize(dtype, &bytes, &mut ours).unwrap();
        let gguf_py = floats(&fixture(&format!("{name}.quantizer.f32")));
        assert_eq!(ours.len(), gguf_py.len(), "{name}");
        let same = ours.iter().zip(&gguf_py).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: gguf-py reads the quantized file differently");
    }
}
