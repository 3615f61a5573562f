// server/core/image_workers.cc: see image_workers.h.
#include "server/core/image_workers.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "base/thread_name.h"

namespace vlmgraph::server {
namespace {

thread_local bool t_on_image_worker = false;

class ImageWorkers {
 public:
  explicit ImageWorkers(int threads) {
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([this] {
        t_on_image_worker = true;
        NameCurrentThread("vlmg-image");
        Loop();
      });
    }
  }
  ~ImageWorkers() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return static_cast<int>(threads_.size()); }

  void Run(const std::function<void()>& task) {
    std::mutex done_mu;
    std::condition_variable done_cv;
    bool done = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back([&] {
        task();  // a packaged_task: never throws, it stores the exception
        std::lock_guard<std::mutex> l(done_mu);
        done = true;
        done_cv.notify_one();
      });
    }
    cv_.notify_one();
    std::unique_lock<std::mutex> l(done_mu);
    done_cv.wait(l, [&] { return done; });
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

ImageWorkers& Pool() {
  static ImageWorkers pool(
      static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1u, 4u)));
  return pool;
}

}  // namespace

void RunOnImageWorker(const std::function<void()>& task) {
  if (t_on_image_worker) {
    task();
    return;
  }
  Pool().Run(task);
}

int image_worker_threads() { return Pool().size(); }

}  // namespace vlmgraph::server
