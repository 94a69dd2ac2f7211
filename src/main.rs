//! The `moe-lanes` command-line interface: the only place that turns library errors into `anyhow`.
fn main() -> anyhow::Result<()> {
    Ok(())
}
