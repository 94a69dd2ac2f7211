//! `moe-lanes quantize IN OUT --type MIX`: a thin layer over `moe_lanes::quantize`.

use crate::emit;
use anyhow::{Context, Result};
use clap::Args;
use moe_lanes::inspect::format_bytes;
use moe_lanes::quantize::{quantize_gguf, QuantMix};
use std::path::PathBuf;

#[derive(Args)]
pub struct QuantizeArgs {
    /// The GGUF file to read.
    input: PathBuf,
    /// The GGUF file to write (as OUT.tmp, renamed when complete).
    output: PathBuf,
    /// The mix: q8_0, q4_0, q5_0, q5_1, iq4_nl, q4_k_m, q5_k_m, q6_k or mxfp4_moe (tensor types
    /// chosen per tensor as llama.cpp does, rows that are not whole 256-value blocks falling
    /// back to Q5_0/Q5_1/Q8_0 as llama.cpp's; mxfp4_moe: expert stacks MXFP4, other matrices Q8_0).
    #[arg(long = "type", value_name = "TYPE")]
    mix: String,
    /// Replace an existing output file (never a device or FIFO).
    #[arg(long)]
    force: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// Parse `--type` (also used by `synth --quant`).
pub fn parse_mix(name: &str, flag: &str) -> Result<QuantMix> {
    QuantMix::parse(name).with_context(|| {
        let names: Vec<&str> = QuantMix::ALL.iter().map(|m| m.name()).collect();
        format!("{flag} {name}: expected one of {}", names.join(", "))
    })
}

pub fn quantize(args: QuantizeArgs) -> Result<()> {
    let mix = parse_mix(&args.mix, "--type")?;
    crate::check_output(&args.output, args.force, &[&args.input])?;
    let bar = crate::byte_progress_bar("quantizing");
    let report = quantize_gguf(&args.input, &args.output, mix, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    let report = report.with_context(|| format!("cannot quantize {}", args.input.display()))?;
    if args.json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&report)?))
    } else {
        let types: Vec<String> = report.tensor_types.iter().map(|(t, n)| format!("{n} {t}")).collect();
        emit(&format!(
            "wrote {} ({}, {} tensors: {}) from {}\n",
            report.path.display(),
            format_bytes(report.output_bytes),
            report.n_tensors,
            types.join(", "),
            format_bytes(report.input_bytes)
        ))
    }
}
