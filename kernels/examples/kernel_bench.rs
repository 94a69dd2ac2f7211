//! Runs the cold-lane kernel bench: `kernel_bench [--json] [--quick] [--threads N] [--simd LEVEL] [--dtype T]`.
//! The `moe-lanes bench-kernels` CLI command calls the same `run_kernel_bench`.

use moe_lanes_kernels::{run_kernel_bench, KernelBenchOptions, SimdLevel, WeightDType};

fn main() {
    let mut opts = KernelBenchOptions::default();
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--quick" => opts.quick = true,
            "--threads" => {
                opts.threads = Some(args.next().and_then(|v| v.parse().ok()).expect("--threads N"))
            }
            "--simd" => {
                opts.simd = Some(SimdLevel::parse(&args.next().expect("--simd LEVEL")).expect("SIMD level"))
            }
            "--dtype" => {
                let name = args.next().expect("--dtype TYPE");
                opts.dtype = Some(WeightDType::parse(&name).expect("weight dtype"))
            }
            other => panic!("unknown argument {other}"),
        }
    }
    match run_kernel_bench(opts) {
        Ok(report) => println!("{}", if json { report.to_json() } else { report.to_text() }),
        Err(err) => {
            eprintln!("kernel bench failed: {err}");
            std::process::exit(1);
        }
    }
}
