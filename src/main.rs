//! The `agentgate` binary; everything lives in the library.

fn main() -> std::process::ExitCode {
    agentgate::main()
}
