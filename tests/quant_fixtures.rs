//! The oracle's dequantisation (`format::quant`) against gguf-py's on committed fixtures
//! (tests/fixtures/make_quant.py): equal bit for bit, block by block, for every block type; and
//! the quantiser's output, as `moe-lanes quantize` wrote it and gguf-py read it back, equal to
//! what moe-lanes computes from the same input; and the MXFP4 quantiser equal, byte for byte, to
//! llama.cpp's `quantize_row_mxfp4_ref` as gguf-py implements it, on edge cases (zeros, ties
//! between levels, powers of two, tiny and large blocks); Q5_0, Q5_1 and IQ4_NL dequantised as
//! gguf-py does, and the Q5_0/Q5_1 quantisers equal to gguf-py's (llama.cpp's reference ones).

use moe_lanes::format::dtype::DType;
use moe_lanes::format::quant::{dequantize, quantize};
use std::path::PathBuf;

const TYPES: [(&str, DType); 6] = [
    ("q8_0", DType::Q8_0),
    ("q4_0", DType::Q4_0),
    ("q4_k", DType::Q4_K),
    ("q5_k", DType::Q5_K),
    ("q6_k", DType::Q6_K),
    ("mxfp4", DType::MXFP4),
];

/// The 32-value types added for llama.cpp's k-quant fallbacks: dequantisation fixtures from
/// their own seed (tests/fixtures/make_quant.py `write_small_type_fixtures`).
const SMALL_TYPES: [(&str, DType); 3] =
    [("q5_0", DType::Q5_0), ("q5_1", DType::Q5_1), ("iq4_nl", DType::IQ4_NL)];

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn dequantization_equals_gguf_py_block_by_block() {
    for (name, dtype) in TYPES.into_iter().chain(SMALL_TYPES) {
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

#[test]
fn mxfp4_quantizer_writes_gguf_py_reference_blocks_byte_for_byte() {
    let input = floats(&fixture("mxfp4.quant_input.f32"));
    let reference = fixture("mxfp4.quant_ref.blocks");
    let mut ours = Vec::new();
    quantize(DType::MXFP4, &input, &mut ours).unwrap();
    assert_eq!(ours.len(), reference.len());
    for (i, (a, b)) in ours.chunks_exact(17).zip(reference.chunks_exact(17)).enumerate() {
        assert_eq!(a, b, "block {i}: {:?}", &input[32 * i..32 * i + 32]);
    }
}

/// The fixture's blocks with scale 0xFF (NaN in the MX spec) decode as llama.cpp's CPU code and
/// gguf-py decode them (`2^127` times the level: infinities beyond level 1), and `check_mxfp4_scales`
/// refuses them as llama.cpp's row validation does.
#[test]
fn mxfp4_nan_scale_decodes_like_gguf_py_and_is_refused_by_validation() {
    use moe_lanes::format::quant::{check_mxfp4_scales, QuantError};
    let blocks = fixture("mxfp4.blocks");
    let block = &blocks[4 * 17..5 * 17];
    assert_eq!(block[0], 0xFF, "the fixture's fifth block has the NaN scale");
    let mut got = [0.0f32; 32];
    dequantize(DType::MXFP4, block, &mut got).unwrap();
    assert!(got.iter().all(|v| !v.is_nan()), "{got:?}");
    assert_eq!(
        check_mxfp4_scales(DType::MXFP4, &blocks),
        Err(QuantError::NanScale { dtype: DType::MXFP4, block: 4 })
    );
    assert_eq!(check_mxfp4_scales(DType::MXFP4, &blocks[5 * 17..]), Ok(()));
}

/// Q5_0 / Q5_1: the quantiser writes gguf-py's blocks (llama.cpp's `quantize_row_q5_0_ref` /
/// `q5_1_ref`) byte for byte on edge cases (zeros, a constant block, ties, tiny, large), and
/// gguf-py's dequantisation of those blocks equals ours bit for bit.
#[test]
fn q5_quantizers_write_gguf_py_reference_blocks_and_dequantize_like_gguf_py() {
    for (name, dtype) in &SMALL_TYPES[..2] {
        let input = floats(&fixture(&format!("{name}.quant_input.f32")));
        let reference = fixture(&format!("{name}.quant_ref.blocks"));
        let mut ours = Vec::new();
        quantize(*dtype, &input, &mut ours).unwrap();
        assert_eq!(ours.len(), reference.len(), "{name}");
        let bb = dtype.block_bytes();
        for (i, (a, b)) in ours.chunks_exact(bb).zip(reference.chunks_exact(bb)).enumerate() {
            assert_eq!(a, b, "{name} block {i}: {:?}", &input[32 * i..32 * i + 32]);
        }
        let want = floats(&fixture(&format!("{name}.quant_ref.f32")));
        let mut got = vec![0.0f32; input.len()];
        dequantize(*dtype, &ours, &mut got).unwrap();
        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: gguf-py dequantises our blocks differently");
    }
}
