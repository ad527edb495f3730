// metrale: inspect the runtime's backends and check them.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "commands.h"
#include "metrale/error.h"

int main(int argc, char** argv) {
  CLI::App app{"metrale: a GPU runtime for quantized LLM inference"};
  app.require_subcommand(1);
  app.footer(
      "Examples:\n"
      "  metrale info                 backends, devices, modules and kernel metadata\n"
      "  metrale info --json          the same as one JSON document\n"
      "  metrale check --backend cpu  run the self-check on the CPU backend\n"
      "Exit codes: 0 ok, 1 a check failed, 2 bad usage or input.");

  metrale::cli::CommonOptions opts;
  auto add_common = [&](CLI::App* cmd) {
    cmd->add_option("--backend", opts.backend, "auto (CUDA when available, else CPU), cpu, cuda")
        ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
    cmd->add_flag("--json", opts.json, "print one JSON document for scripts");
  };
  CLI::App* info = app.add_subcommand("info", "list backends, modules and kernel metadata");
  add_common(info);
  CLI::App* check = app.add_subcommand("check", "self-check the chosen backend");
  add_common(check);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    if (info->parsed()) return metrale::cli::run_info(opts);
    if (check->parsed()) return metrale::cli::run_check(opts);
  } catch (const metrale::Error& e) {
    std::fprintf(stderr, "metrale: %s\n", e.what());
    return e.code() == metrale::ErrorCode::kInvalidArgument ||
                   e.code() == metrale::ErrorCode::kUnavailable
               ? 2
               : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "metrale: %s\n", e.what());
    return 1;
  }
  return 2;
}
