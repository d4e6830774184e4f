// libibverbs, loaded at run time (ib_loader.h).
#include "plugin/ibverbs/ib_loader.h"

#include <dlfcn.h>

namespace dq::net::ib {
namespace {

template <typename Fn>
bool load_sym(void* lib, const char* name, Fn* out, std::string* why) {
  *out = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*out == nullptr) *why = std::string("libibverbs.so.1 lacks ") + name;
  return *out != nullptr;
}

}  // namespace

bool load_verbs(Verbs* v, std::string* why) {
  v->lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (v->lib == nullptr) {
    const char* e = dlerror();
    *why = std::string("cannot load libibverbs.so.1: ") + (e != nullptr ? e : "unknown error");
    return false;
  }
  const bool required = load_sym(v->lib, "ibv_get_device_list", &v->get_device_list, why) &&
                        load_sym(v->lib, "ibv_free_device_list", &v->free_device_list, why) &&
                        load_sym(v->lib, "ibv_get_device_name", &v->get_device_name, why) &&
                        load_sym(v->lib, "ibv_get_device_guid", &v->get_device_guid, why) &&
                        load_sym(v->lib, "ibv_open_device", &v->open_device, why) &&
                        load_sym(v->lib, "ibv_close_device", &v->close_device, why) &&
                        load_sym(v->lib, "ibv_query_device", &v->query_device, why) &&
                        load_sym(v->lib, "ibv_query_port", &v->query_port, why) &&
                        load_sym(v->lib, "ibv_query_gid", &v->query_gid, why) &&
                        load_sym(v->lib, "ibv_alloc_pd", &v->alloc_pd, why) &&
                        load_sym(v->lib, "ibv_dealloc_pd", &v->dealloc_pd, why) &&
                        load_sym(v->lib, "ibv_reg_mr", &v->reg_mr, why) &&
                        load_sym(v->lib, "ibv_dereg_mr", &v->dereg_mr, why) &&
                        load_sym(v->lib, "ibv_create_cq", &v->create_cq, why) &&
                        load_sym(v->lib, "ibv_destroy_cq", &v->destroy_cq, why) &&
                        load_sym(v->lib, "ibv_create_qp", &v->create_qp, why) &&
                        load_sym(v->lib, "ibv_destroy_qp", &v->destroy_qp, why) &&
                        load_sym(v->lib, "ibv_modify_qp", &v->modify_qp, why) &&
                        load_sym(v->lib, "ibv_query_qp", &v->query_qp, why) &&
                        load_sym(v->lib, "ibv_wc_status_str", &v->wc_status_str, why);
  if (!required) return false;
  // Optional: absent from older libibverbs (then no DMA-BUF, no fork support asked for).
  v->reg_mr_iova2 = reinterpret_cast<decltype(v->reg_mr_iova2)>(dlsym(v->lib, "ibv_reg_mr_iova2"));
  v->fork_init = reinterpret_cast<decltype(v->fork_init)>(dlsym(v->lib, "ibv_fork_init"));
  v->is_fork_initialized =
      reinterpret_cast<decltype(v->is_fork_initialized)>(dlsym(v->lib, "ibv_is_fork_initialized"));
  v->reg_dmabuf_mr =
      reinterpret_cast<decltype(v->reg_dmabuf_mr)>(dlsym(v->lib, "ibv_reg_dmabuf_mr"));
  return true;
}

Verbs& verbs() {
  static Verbs* v = new Verbs;  // never destroyed: comms may outlive statics
  return *v;
}

}  // namespace dq::net::ib
