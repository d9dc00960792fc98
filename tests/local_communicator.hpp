// An in-process stepfuse::Communicator for tests: N threads of one process act as
// N ranks (the sharded step without MPI, under the sanitizers too). A rank that
// waits at a collective longer than a timeout throws instead of hanging, so a
// protocol bug (one rank skipping a collective) fails the test.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "stepfuse/distributed.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::testing {

class LocalGroup {
 public:
  explicit LocalGroup(int ranks, std::chrono::seconds timeout = std::chrono::seconds(180))
      : ranks_(ranks), timeout_(timeout), slots_(static_cast<std::size_t>(ranks), nullptr) {}

  std::shared_ptr<Communicator> communicator(int rank) { return std::make_shared<Rank>(this, rank); }
  int size() const { return ranks_; }

  // Runs fn(rank, communicator) on one thread per rank; returns each rank's
  // exception (null where it returned).
  std::vector<std::exception_ptr> run(const std::function<void(int, const std::shared_ptr<Communicator>&)>& fn) {
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks_));
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks_; ++r)
      threads.emplace_back([&, r] {
        try {
          fn(r, communicator(r));
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
    for (std::thread& t : threads) t.join();
    return errors;
  }

  std::int64_t collectives() const { return collectives_; }  // completed, counted by rank 0

 private:
  // Waits until every rank arrived (a reusable barrier), or throws after the timeout.
  void wait(int rank) {
    std::unique_lock lock(mutex_);
    const std::uint64_t gen = generation_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen; }))
      throw Error(ErrorCode::device_error, "LocalGroup: rank " + std::to_string(rank) +
                                               " waited too long at a collective (a rank skipped it)");
  }

  template <class T>
  static void combine(T* out, const T* in, std::size_t n, ReduceOp op, bool first) {
    for (std::size_t i = 0; i < n; ++i) {
      if (first) out[i] = in[i];
      else if (op == ReduceOp::sum) out[i] = static_cast<T>(out[i] + in[i]);
      else if (op == ReduceOp::max) out[i] = in[i] > out[i] ? in[i] : out[i];
      else out[i] = in[i] < out[i] ? in[i] : out[i];
    }
  }
  // out[0, n) = op over the ranks of slots_[k] + offset elements, in rank order.
  void reduce(void* out, std::size_t offset, std::size_t n, CommType type, ReduceOp op) {
    for (int k = 0; k < ranks_; ++k) {
      const auto* in = static_cast<const unsigned char*>(slots_[static_cast<std::size_t>(k)]) + offset * comm_type_size(type);
      const bool first = k == 0;
      switch (type) {
        case CommType::u8: combine(static_cast<std::uint8_t*>(out), in, n, op, first); break;
        case CommType::i32: combine(static_cast<std::int32_t*>(out), reinterpret_cast<const std::int32_t*>(in), n, op, first); break;
        case CommType::i64: combine(static_cast<std::int64_t*>(out), reinterpret_cast<const std::int64_t*>(in), n, op, first); break;
        case CommType::f32: combine(static_cast<float*>(out), reinterpret_cast<const float*>(in), n, op, first); break;
        case CommType::f64: combine(static_cast<double*>(out), reinterpret_cast<const double*>(in), n, op, first); break;
        default: throw Error(ErrorCode::unsupported, "LocalGroup: no f16/bf16 reductions");
      }
    }
  }

  class Rank final : public Communicator {
   public:
    Rank(LocalGroup* g, int rank) : g_(g), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return g_->ranks_; }
    std::string_view name() const override { return "local"; }
    void all_gather(const void* send, void* recv, std::size_t count, CommType type) override {
      const std::size_t bytes = count * comm_type_size(type);
      publish(send);
      for (int k = 0; k < g_->ranks_; ++k)
        if (bytes) std::memcpy(static_cast<char*>(recv) + static_cast<std::size_t>(k) * bytes, g_->slots_[static_cast<std::size_t>(k)], bytes);
      done();
    }
    void all_reduce(void* data, std::size_t count, CommType type, ReduceOp op) override {
      std::vector<unsigned char> out(count * comm_type_size(type));
      publish(data);
      g_->reduce(out.data(), 0, count, type, op);
      done();  // every rank has read every rank's data: now each writes its own
      if (!out.empty()) std::memcpy(data, out.data(), out.size());
    }
    void reduce_scatter(const void* send, void* recv, std::size_t count, CommType type, ReduceOp op) override {
      publish(send);
      g_->reduce(recv, static_cast<std::size_t>(rank_) * count, count, type, op);
      done();
    }

   private:
    void publish(const void* p) {
      g_->slots_[static_cast<std::size_t>(rank_)] = p;
      g_->wait(rank_);
    }
    void done() {
      g_->wait(rank_);
      if (rank_ == 0) ++g_->collectives_;
    }
    LocalGroup* g_;
    int rank_;
  };

  int ranks_;
  std::chrono::seconds timeout_;
  std::vector<const void*> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  std::int64_t collectives_ = 0;
};

// Runs fn on `ranks` ranks and expects every rank to throw an Error with `code`
// whose message contains `text` (rank `own` may throw its own message instead).
inline void expect_every_rank_throws(int ranks,
                                     const std::function<void(int, const std::shared_ptr<Communicator>&)>& fn,
                                     ErrorCode code, const std::string& text, int own = -1,
                                     const std::string& own_text = "") {
  LocalGroup group(ranks);
  const auto errors = group.run(fn);
  for (int r = 0; r < ranks; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " did not throw";
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << "rank " << r << ": " << e.what();
      const std::string& want = r == own ? own_text : text;
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << "rank " << r << ": " << e.what();
    }
  }
}

}  // namespace stepfuse::testing
