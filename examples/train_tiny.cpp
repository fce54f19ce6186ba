// The smallest complete program: three dense layers y = W x + b trained on 4 thread ranks with
// full sharding. docs/guide.md quotes it; the tests build and run it (example.train_tiny).
// examples/train_mlp.cpp is the same shape with options, statistics and bf16.
#include <cstdio>
#include <memory>
#include <span>
#include <vector>

#include <fsdp/fsdp.hpp>

struct layer {
  int in, out;
  fsdp::buffer<float> w, b;  // the engine's own parameter handles
  layer(int i, int o) : in(i), out(o), w(static_cast<std::size_t>(i) * o, "w"), b(static_cast<std::size_t>(o), "b") {}
};

int main() {
  const int batch = 8;  // per rank
  std::vector<double> losses;
  fsdp::threads::world{4}.run([&](fsdp::threads::communicator& comm) {
    std::vector<std::unique_ptr<layer>> layers;  // declared before the group: handles outlive it
    for (auto [i, o] : {std::pair{16, 32}, std::pair{32, 32}, std::pair{32, 1}})
      layers.push_back(std::make_unique<layer>(i, o));

    fsdp::shard_group<fsdp::buffer<float>> group{comm, {}, {.sharding = fsdp::full_shard(), .prefetch = {.forward = 1, .backward = 1}}};
    for (auto& l : layers) group.add_unit({&l->w, &l->b});  // unit u = layer u
    group.finalize(fsdp::init::per_shard([](const fsdp::param_slice& s, std::span<float> out) {
      for (std::size_t i = 0; i < out.size(); ++i)  // a pure function of (unit, index, element)
        out[i] = 0.02f * static_cast<float>((s.unit * 7 + s.index * 3 + s.offset + i) % 11) - 0.1f;
    }));
    fsdp::adamw opt{group, {.lr = 1e-2f, .weight_decay = 0.0f}};

    for (int step = 0; step < 50; ++step) {
      std::vector<std::vector<float>> acts(1, std::vector<float>(batch * 16));
      for (std::size_t k = 0; k < acts[0].size(); ++k) acts[0][k] = 0.01f * static_cast<float>((k * 13 + comm.rank()) % 100) - 0.5f;
      for (std::size_t u = 0; u < layers.size(); ++u) {
        auto in_use = group.forward(static_cast<int>(u));  // gathered: w.data(), b.data() are full
        const layer& l = *layers[u];
        std::vector<float> y(static_cast<std::size_t>(batch * l.out));
        for (int s = 0; s < batch; ++s)
          for (int o = 0; o < l.out; ++o) {
            float acc = l.b.data()[o];
            for (int i = 0; i < l.in; ++i) acc += l.w.data()[o * l.in + i] * acts[u][s * l.in + i];
            y[s * l.out + o] = acc;
          }
        acts.push_back(std::move(y));
      }  // scope end: layer u resharded
      std::vector<float> dy(batch);
      double loss = 0;
      for (int s = 0; s < batch; ++s) {
        const float d = acts.back()[s] - 0.25f;  // target 0.25
        loss += 0.5 * d * d / batch;
        dy[s] = d / batch;
      }
      for (std::size_t u = layers.size(); u-- > 0;) {
        auto in_use = group.backward(static_cast<int>(u));  // gathered again; grad() is zeroed storage
        layer& l = *layers[u];
        std::vector<float> dx(static_cast<std::size_t>(batch * l.in), 0.0f);
        for (int s = 0; s < batch; ++s)
          for (int o = 0; o < l.out; ++o) {
            const float g = dy[s * l.out + o];
            l.b.grad()[o] += g;  // add (+=) into the gradient storage
            for (int i = 0; i < l.in; ++i) {
              l.w.grad()[o * l.in + i] += g * acts[u][s * l.in + i];
              dx[s * l.in + i] += g * l.w.data()[o * l.in + i];
            }
          }
        dy = std::move(dx);
      }  // scope end: gradients reduce-scattered (averaged) into this rank's shard
      opt.step();       // finish_backward, then AdamW on the local shards only
      opt.zero_grad();  // zero the gradient shards for the next step
      if (comm.rank() == 0) losses.push_back(loss);
      if (comm.rank() == 0 && step % 10 == 0) std::printf("step %d loss %.6f\n", step, loss);
    }
  });
  std::printf("rank 0's loss: %.6f at step 0, %.6f at step 49\n", losses.front(), losses.back());
  return losses.back() < 0.5 * losses.front() ? 0 : 1;  // it trained (the test runs this)
}
