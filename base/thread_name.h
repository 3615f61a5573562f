// base/thread_name.h: names for the process's threads, as `top -H`, `ps -L`, gdb, perf and
// bench/thread_cpu.py show them (the server's GPU threads, its fronts' I/O, worker and stream
// threads).
//
//   NameCurrentThread("vlmg-gpu0");                       // a thread this code starts
//   net::post(pool, [] { NameThreadOnce("vlmg-grpc-strm"); ... });  // a pool's thread, first task
//
// Linux keeps at most 15 bytes of a name (pthread_setname_np(3)); longer names are cut there.
// Naming never fails the caller: an error is ignored. Any thread; each call names the calling
// thread only.
#pragma once

#include <pthread.h>

#include <string>

namespace vlmgraph {

inline void NameCurrentThread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

// For threads a library starts (Boost.Asio's thread_pool): names the calling thread the first
// time it runs this, then costs one thread_local test per call. A thread serves one pool, so one
// flag per thread is enough.
inline void NameThreadOnce(const char* name) {
  thread_local bool named = false;
  if (named) return;
  NameCurrentThread(name);
  named = true;
}

}  // namespace vlmgraph
