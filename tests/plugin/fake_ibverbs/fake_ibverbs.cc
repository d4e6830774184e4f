// A recording libibverbs.so.1 for net_ib_fork_support: each entry point the plugin loads appends
// its name to the file DQ_FAKE_VERBS_LOG names (one line a call), and the device list is empty,
// so the plugin serves on sockets after its discovery. It reports fork support as not yet asked
// for (IBV_FORK_DISABLED, the answer of a kernel without RDMA copy-on-fork), so that the plugin
// must ask. Not rdma-core's ABI beyond the names and the C calling convention the plugin's table
// uses: <infiniband/verbs.h> defines some of these names as macros, so it is not included.
#include <cstdio>
#include <cstdlib>

namespace {

void record(const char* name) {
  const char* path = std::getenv("DQ_FAKE_VERBS_LOG");
  if (path == nullptr) return;
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%s\n", name);
    std::fclose(f);
  }
}

void* g_empty_list[1] = {nullptr};
bool g_fork_asked = false;

}  // namespace

// The project compiles with -fvisibility=hidden: each entry point is exported by name.
#define FAKE_VERBS_API __attribute__((visibility("default")))

extern "C" {

// enum ibv_fork_status: IBV_FORK_DISABLED 0, IBV_FORK_ENABLED 1, IBV_FORK_UNNEEDED 2.
FAKE_VERBS_API int ibv_is_fork_initialized() {
  record("ibv_is_fork_initialized");
  return g_fork_asked ? 1 : 0;
}
FAKE_VERBS_API int ibv_fork_init() {
  record("ibv_fork_init");
  g_fork_asked = true;
  return 0;
}
FAKE_VERBS_API void** ibv_get_device_list(int* n) {
  record("ibv_get_device_list");
  if (n != nullptr) *n = 0;
  return g_empty_list;
}
FAKE_VERBS_API void ibv_free_device_list(void**) {
  record("ibv_free_device_list");
}
FAKE_VERBS_API const char* ibv_get_device_name(void*) {
  record("ibv_get_device_name");
  return "fake";
}
FAKE_VERBS_API unsigned long long ibv_get_device_guid(void*) {
  record("ibv_get_device_guid");
  return 0;
}
FAKE_VERBS_API void* ibv_open_device(void*) {
  record("ibv_open_device");
  return nullptr;
}
FAKE_VERBS_API int ibv_close_device(void*) {
  record("ibv_close_device");
  return -1;
}
FAKE_VERBS_API int ibv_query_device(void*, void*) {
  record("ibv_query_device");
  return -1;
}
FAKE_VERBS_API int ibv_query_port(void*, unsigned char, void*) {
  record("ibv_query_port");
  return -1;
}
FAKE_VERBS_API int ibv_query_gid(void*, unsigned char, int, void*) {
  record("ibv_query_gid");
  return -1;
}
FAKE_VERBS_API void* ibv_alloc_pd(void*) {
  record("ibv_alloc_pd");
  return nullptr;
}
FAKE_VERBS_API int ibv_dealloc_pd(void*) {
  record("ibv_dealloc_pd");
  return -1;
}
FAKE_VERBS_API void* ibv_reg_mr(void*, void*, size_t, int) {
  record("ibv_reg_mr");
  return nullptr;
}
FAKE_VERBS_API int ibv_dereg_mr(void*) {
  record("ibv_dereg_mr");
  return -1;
}
FAKE_VERBS_API void* ibv_create_cq(void*, int, void*, void*, int) {
  record("ibv_create_cq");
  return nullptr;
}
FAKE_VERBS_API int ibv_destroy_cq(void*) {
  record("ibv_destroy_cq");
  return -1;
}
FAKE_VERBS_API void* ibv_create_qp(void*, void*) {
  record("ibv_create_qp");
  return nullptr;
}
FAKE_VERBS_API int ibv_destroy_qp(void*) {
  record("ibv_destroy_qp");
  return -1;
}
FAKE_VERBS_API int ibv_modify_qp(void*, void*, int) {
  record("ibv_modify_qp");
  return -1;
}
FAKE_VERBS_API int ibv_query_qp(void*, void*, int, void*) {
  record("ibv_query_qp");
  return -1;
}
FAKE_VERBS_API const char* ibv_wc_status_str(int) {
  record("ibv_wc_status_str");
  return "fake";
}

}  // extern "C"
