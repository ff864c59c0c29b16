fn main() -> std::process::ExitCode {
    sluice::cli::main()
}
