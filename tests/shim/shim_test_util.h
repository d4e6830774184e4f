// Support shared by the shim's multi-process test programs (shim_multirank, shim_hierarchy,
// shim_range, shim_ops): the per-run scratch directory, forking ranks with their own settings,
// the killed-rank scenario and the program's main. Each scenario's code exists once, here or in
// the one program that runs it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/nccl_api.h"
#include "tests/common/cross_rank.h"
#include "tests/common/rank_harness.h"
#include "tests/common/text_file.h"

namespace dq::sim {
struct Matrix;
struct SyntheticSpec;
}  // namespace dq::sim

namespace dq::shim_test {

using Env = std::vector<std::pair<std::string, std::string>>;
using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);

// The shim's per-communicator counters (rerouted, passed through); null when not preloaded.
CountersFn counters_fn();
// The calls the shim compressed on `comm` so far; ~0 when it cannot say.
unsigned long long rerouted_calls(ncclComm_t comm);

// This run's scratch directory (rank logs, result files), made by scenario_main.
extern std::string g_dir;

using dq::test::count_occurrences;
using dq::test::read_file;
using dq::test::write_text;
// g_dir/<what><r>: a file rank r writes for the parent.
std::string rank_file(int r, const char* what);
// Rank r's stderr, as run_ranks saved it.
std::string rank_log(int r);

// Creates rank r's communicator of n ranks: blocking and named `comm_name` (ncclConfig_t) when
// not null, else with ncclCommInitRank.
ncclResult_t init_comm(ncclComm_t* comm, int n, const ncclUniqueId& id, int r,
                       const char* comm_name);

// Forks n ranks; rank r sends its stderr to g_dir/rank<r>.log, applies env(r), creates its
// communicator (named `comm_name` when not null) and runs body(rank, comm). Returns the ranks'
// exit codes (-signal if killed, 124 if hung, 125 if killed after another rank failed).
// `expected` says which ends pass (empty: exit 0); the first other end kills the other ranks.
std::vector<int> run_ranks(int n, const std::function<Env(int)>& env,
                           const std::function<int(int, ncclComm_t)>& body, int timeout_s,
                           const char* comm_name = nullptr,
                           std::function<bool(int, const dq::test::RankExit&)> expected = {});

// True when every code is 0; otherwise prints the failing rank's log (a rank that ended because
// another failed, 125, only when no other failed) and fails naming `what`.
bool all_zero(const std::vector<int>& codes, const char* what);

using dq::test::same_bytes_everywhere;

// A rank SIGKILLed inside a collective: every survivor must get an error from a call within
// DYNAMIQ_TIMEOUT_MS + 5 s, exit without hanging, and every call before the kill must be exact.
struct KillSpec {
  int n = 4;               // ranks
  size_t count = 4 << 20;  // FP32 values per call
  int timeout_ms = 3000;   // DYNAMIQ_TIMEOUT_MS
  int victim_step = 1;     // run r kills rank (r * victim_step + victim_offset) % n
  int victim_offset = 0;
  int delay_step_ms = 9;  // run r kills (r * delay_step_ms) % delay_mod_ms ms into call 2
  int delay_mod_ms = 50;
  std::function<Env(int)> env;  // rank r's settings, DYNAMIQ_TIMEOUT_MS = timeout_ms among them
  const char* label = "killed rank";  // names the run in the summary line
};
// `collective`: allreduce, reducescatter (count / n values per rank) or reduce (root 0).
bool scenario_kill(const KillSpec& spec, int runs, const std::string& collective);

// The A/B switch: rank 0 writes the control file g_dir/switch ("on" first, "off" before call 3,
// "1" before call 6); rank 0 reads the file on every call, and every rank applies what it read a
// control window of calls later (docs/ENGINE.md section 3).
struct ToggleSpec {
  int n = 4;
  std::function<Env(int, const std::string&)> env;  // rank r's settings, given the control file
  // One call of rank `rank`: 0 when its result is right (exact whenever passed through), else
  // the rank's exit code; *rerouted whether it was compressed, *seen the rerouted counter.
  std::function<int(int, ncclComm_t, unsigned long long*, bool*)> call;
  const char* label = "A/B switch";  // names the run in the summary line
};
// Rank 0 turns the file off before call 3 and on before call 6; eligible call k applies what call
// k - W read (W: the default DYNAMIQ_CONTROL_WINDOW, which `env` must leave unset; for k < W the
// handshake's state, on). 6 + W + 2 calls, every rank the same pattern.
bool scenario_toggle(const ToggleSpec& spec);

// The ranks' data, made in the parent before it forks them: on one thread, as TBB's workers
// would outlive the call (rank_harness.h).
void make_rows(const dq::sim::SyntheticSpec& spec, dq::sim::Matrix* rows);
// make_rows of n rows of `cols` values, spread 1, seed `seed`.
void make_rows(int n, size_t cols, uint64_t seed, dq::sim::Matrix* rows);
// Rank r's input in the call's element type (`rows` holds FP32; BF16 rounds to nearest even).
std::vector<unsigned char> typed_input(const dq::sim::Matrix& rows, int rank, size_t count,
                                       bool bf16);
// Rank w's element i as the reduction sees it: FP32, or rounded to BF16 for a BF16 call.
float input(const dq::sim::Matrix& rows, int w, size_t i, bool bf16);

// How one scenario of a program ended.
enum class Outcome { pass, fail, skip, unknown };
inline Outcome outcome(bool pass) {
  return pass ? Outcome::pass : Outcome::fail;
}

// A program's main: needs min_argc arguments (else prints usage, exit 2) and the preloaded shim
// (else exit 77), makes g_dir from dir_template ("/tmp/...-XXXXXX"), runs run(argv[1]) and
// prints "PASS|FAIL: <scenario><suffix>"; g_dir is removed after a pass or a skip. Exit 0 pass, 1
// fail, 2 unknown scenario, 77 skip (the scenario printed its "SKIP: reason").
int scenario_main(int argc, char** argv, int min_argc, const char* usage, const char* dir_template,
                  const std::string& suffix, const std::function<Outcome(const std::string&)>& run);

}  // namespace dq::shim_test
