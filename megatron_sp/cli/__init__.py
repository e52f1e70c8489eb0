"""The command-line edge: argparse with Megatron-LM's flag names (arguments), the mapping of
Megatron-LM's other flags (megatron_compat), and the one place where the parsed namespace becomes the
typed, frozen `megatron_sp.config.JobConfig` the library takes (build). Nothing outside this package
reads the argparse namespace."""
