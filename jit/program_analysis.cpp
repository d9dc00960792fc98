// Lowering update programs for the interpreter: operand resolution,
// superinstructions, in-place streams, slot allocation.
#include "jit/program_analysis.hpp"

#include <algorithm>
#include <string>

#include "jit/base/format.hpp"

namespace stepfuse::jit {

namespace {

LInstr instr(LKind kind) {
  LInstr li;
  li.kind = kind;
  return li;
}

struct Lowering {
  const Program& p;
  DType weight, grad;
  bool masters;
  std::vector<std::vector<int>> users;  // program value -> using instruction indices
  std::vector<bool> folded;             // mul folded into its single user
  std::vector<LOperand> where;          // program value -> where it lives
  LoweredProgram out;

  bool is_f32_stream(int s) const {
    switch (p.streams[s].role) {
      case StreamRole::grad: return grad == DType::f32;
      case StreamRole::param: return masters || weight == DType::f32;
      case StreamRole::state: return true;
    }
    return false;
  }
  LOperand stream_operand(int s) const {
    LOperand o;
    o.kind = p.streams[s].role == StreamRole::grad    ? LOperand::Kind::grad
             : p.streams[s].role == StreamRole::param ? LOperand::Kind::param
                                                      : LOperand::Kind::state;
    o.index = static_cast<std::uint8_t>(s);
    return o;
  }
  static LOperand slot_for(int value) {
    LOperand o;
    o.kind = LOperand::Kind::slot;
    o.value = static_cast<std::uint16_t>(value);
    return o;
  }
  // The last instruction that reads v, where a read by a folded mul counts at
  // the mul's user (that is where the superinstruction reads it).
  int last_use(int v) const {
    int last = v;
    for (int u : users[v]) last = std::max(last, folded[u] ? users[u].front() : u);
    return last;
  }
  bool single_mul(int v) const { return p.code[v].op == Op::mul && users[v].size() == 1; }

  // When is stream s overwritten? The store's own index, or the index of the
  // op that produces the stored value when it can write the stream directly.
  int store_index(int s) const {
    for (int i = 0; i < p.num_instrs; ++i)
      if (p.code[i].op == Op::store && p.code[i].attr == s) return i;
    return -1;
  }
  // The last instruction that reads stream s through any of its loads (a program may
  // load a stream more than once); -1 when nothing loads it.
  int last_read(int s) const {
    int last = -1;
    for (int i = 0; i < p.num_instrs; ++i)
      if (p.code[i].op == Op::load && p.code[i].attr == s) last = std::max(last, last_use(i));
    return last;
  }

  void analyze() {
    users.assign(p.num_instrs, {});
    for (int i = 0; i < p.num_instrs; ++i) {
      const Instr& in = p.code[i];
      const std::uint16_t ops[3] = {in.a, in.b, in.c};
      for (int k = 0; k < op_arity(in.op); ++k) users[ops[k]].push_back(i);
    }
    folded.assign(p.num_instrs, false);
    for (int i = 0; i < p.num_instrs; ++i) {
      const Instr& in = p.code[i];
      if (in.op == Op::add) {
        if (single_mul(in.a)) folded[in.a] = true;
        if (single_mul(in.b)) folded[in.b] = true;
      } else if (in.op == Op::sub && single_mul(in.b)) {
        folded[in.b] = true;
      }
    }
  }

  LOperand operand(int v) const { return where[v]; }

  void emit(LInstr li) { out.code.push_back(li); }

  void run() {
    analyze();
    where.assign(p.num_instrs, LOperand{});
    // Decide where each stored value is written: directly into its fp32 stream
    // when the producing op comes after every read of the stream's old contents.
    std::vector<int> direct_store(p.num_instrs, -1);  // value -> stream written directly
    std::vector<bool> stream_direct(kMaxStreams, false);
    for (int i = 0; i < p.num_instrs; ++i) {
      const Instr& st = p.code[i];
      if (st.op != Op::store || !is_f32_stream(st.attr)) continue;
      const int v = st.a;
      const Op vop = p.code[v].op;
      // (values that are not computed into a destination: loads, scalars, constants, norms)
      if (vop == Op::load || vop == Op::scalar || vop == Op::constant || vop == Op::tensor_norm || direct_store[v] >= 0)
        continue;
      if (last_read(st.attr) > v) continue;  // old contents still read after v is produced
      direct_store[v] = st.attr;
      stream_direct[st.attr] = true;
    }
    for (int i = 0; i < p.num_instrs; ++i) {
      const Instr& in = p.code[i];
      switch (in.op) {
        case Op::scalar: where[i] = {LOperand::Kind::scalar, in.attr}; continue;
        case Op::tensor_norm: where[i] = {LOperand::Kind::norm, in.attr}; continue;
        case Op::reduce_sumsq: {
          LInstr li = instr(LKind::reduce);
          li.attr = in.attr;
          li.src[0] = operand(in.a);
          li.num_src = 1;
          emit(li);
          continue;
        }
        case Op::constant: where[i] = {LOperand::Kind::constant, 0, in.imm}; continue;
        case Op::load: {
          const int s = in.attr;
          if (is_f32_stream(s)) {
            // In place, unless the stream is overwritten (by a copy at its store) while still read.
            const int overwritten = stream_direct[s] ? -1 : store_index(s);
            if (overwritten < 0 || last_use(i) <= overwritten) {
              where[i] = stream_operand(s);
              continue;
            }
            LInstr li = instr(LKind::copy);
            li.dst = where[i] = slot_for(i);
            li.src[0] = stream_operand(s);
            li.num_src = 1;
            emit(li);
          } else {
            LInstr li = instr(LKind::widen);  // reads src[0]'s stream as stored (num_src stays 0)
            li.src[0] = stream_operand(s);
            li.dst = where[i] = slot_for(i);
            emit(li);
          }
          continue;
        }
        case Op::store: {
          const int s = in.attr;
          if (direct_store[in.a] == s) {
            if (p.streams[s].role == StreamRole::param && masters) {
              LInstr li = instr(LKind::narrow);  // masters written directly; the weights follow
              li.src[0] = stream_operand(s);
              li.num_src = 1;
              emit(li);
            }
            continue;
          }
          LInstr li = instr(is_f32_stream(s) ? LKind::copy : LKind::narrow);
          li.dst = is_f32_stream(s) ? stream_operand(s) : LOperand{};
          li.src[0] = operand(in.a);
          li.num_src = 1;
          emit(li);
          if (is_f32_stream(s) && p.streams[s].role == StreamRole::param && masters) {
            LInstr w = instr(LKind::narrow);
            w.src[0] = stream_operand(s);
            w.num_src = 1;
            emit(w);
          }
          continue;
        }
        default: break;
      }
      if (folded[i]) continue;  // computed inside its user
      LInstr li;
      const auto mul_parts = [&](int m, int at) {
        li.src[at] = operand(p.code[m].a);
        li.src[at + 1] = operand(p.code[m].b);
      };
      if (in.op == Op::add && folded[in.a] && folded[in.b]) {
        li.kind = LKind::axpby;
        mul_parts(in.a, 0);
        mul_parts(in.b, 2);
        li.num_src = 4;
      } else if (in.op == Op::add && (folded[in.a] || folded[in.b])) {
        li.kind = LKind::madd;
        const int m = folded[in.a] ? in.a : in.b;
        mul_parts(m, 0);
        li.src[2] = operand(m == in.a ? in.b : in.a);
        li.num_src = 3;
      } else if (in.op == Op::sub && folded[in.b]) {
        li.kind = LKind::msub;
        mul_parts(in.b, 0);
        li.src[2] = operand(in.a);
        li.num_src = 3;
      } else {
        const int n = op_arity(in.op);
        li.kind = n == 1 ? LKind::unary : n == 2 ? LKind::binary : LKind::ternary;
        li.op = in.op;
        li.attr = in.attr;
        const std::uint16_t ops[3] = {in.a, in.b, in.c};
        for (int k = 0; k < n; ++k) li.src[k] = operand(ops[k]);
        li.num_src = n;
      }
      li.dst = where[i] = direct_store[i] >= 0 ? stream_operand(direct_store[i]) : slot_for(i);
      emit(li);
    }
    allocate_slots();
  }

  // Linear scan over the lowered code: a slot is free after its value's last read.
  void allocate_slots() {
    std::vector<int> last(p.num_instrs, -1);
    for (int k = 0; k < static_cast<int>(out.code.size()); ++k)
      for (int s = 0; s < out.code[k].num_src; ++s)
        if (out.code[k].src[s].kind == LOperand::Kind::slot) last[out.code[k].src[s].value] = k;
    std::vector<int> slot_of(p.num_instrs, -1);
    std::vector<int> free_slots;
    int slots = 0;
    for (int k = 0; k < static_cast<int>(out.code.size()); ++k) {
      LInstr& li = out.code[k];
      for (int s = 0; s < li.num_src; ++s) {
        LOperand& o = li.src[s];
        if (o.kind != LOperand::Kind::slot) continue;
        o.index = static_cast<std::uint8_t>(slot_of[o.value]);
      }
      // Free the sources read for the last time (elementwise: the result may reuse them).
      for (int s = 0; s < li.num_src; ++s) {
        const LOperand& o = li.src[s];
        if (o.kind == LOperand::Kind::slot && last[o.value] == k && slot_of[o.value] >= 0) {
          free_slots.push_back(slot_of[o.value]);
          slot_of[o.value] = -2;  // freed once even if read twice by this op
        }
      }
      if (li.dst.kind == LOperand::Kind::slot) {
        int slot;
        if (!free_slots.empty()) {
          slot = free_slots.back();
          free_slots.pop_back();
        } else {
          slot = slots++;
        }
        slot_of[li.dst.value] = slot;
        li.dst.index = static_cast<std::uint8_t>(slot);
        if (last[li.dst.value] < 0) free_slots.push_back(slot);  // never read
      }
    }
    out.num_slots = slots;
  }
};

std::string operand_text(const LOperand& o) {
  switch (o.kind) {
    case LOperand::Kind::none: return "-";
    case LOperand::Kind::slot: return std::string("t").append(std::to_string(o.index));
    case LOperand::Kind::grad: return "grad[]";
    case LOperand::Kind::param: return "param[]";
    case LOperand::Kind::state: return std::string("state").append(std::to_string(o.index)) + "[]";
    case LOperand::Kind::scalar: return std::string("s").append(std::to_string(o.index));
    case LOperand::Kind::constant: return detail::format_float(o.imm);
    case LOperand::Kind::norm: return std::string("norm").append(std::to_string(o.index));
  }
  return "?";
}

}  // namespace

LoweredProgram lower(const Program& program, DType weight, DType grad, bool masters) {
  validate(program);
  const bool m = masters && weight != DType::f32;
  if (!is_two_phase(program)) {
    Lowering l{program, weight, grad, m, {}, {}, {}, {}};
    l.run();
    return std::move(l.out);
  }
  // Each phase on its own: no value crosses the marker, so the two share the slots.
  LoweredProgram out;
  out.two_phase = true;
  for (int part = 0; part < 2; ++part) {
    const Program sub = phase_program(program, part);
    Lowering l{sub, weight, grad, m, {}, {}, {}, {}};
    l.run();
    if (part == 1) out.phase2_begin = static_cast<int>(out.code.size());
    out.code.insert(out.code.end(), l.out.code.begin(), l.out.code.end());
    out.num_slots = std::max(out.num_slots, l.out.num_slots);
  }
  return out;
}

std::string to_string(const LoweredProgram& lowered) {
  static constexpr const char* kNames[] = {"unary", "binary", "ternary", "madd", "msub",
                                           "axpby", "widen",  "narrow",  "copy", "reduce"};
  std::string s;
  for (std::size_t k = 0; k < lowered.code.size(); ++k) {
    const LInstr& li = lowered.code[k];
    if (lowered.two_phase && k == static_cast<std::size_t>(lowered.phase2_begin)) s += "phase\n";
    s += li.kind == LKind::narrow   ? std::string("weight[]")
         : li.kind == LKind::reduce ? std::string("r").append(std::to_string(li.attr))
                                    : operand_text(li.dst);
    s.append(" = ").append(kNames[static_cast<int>(li.kind)]);
    if (li.kind == LKind::widen) s.append(" ").append(li.src[0].kind == LOperand::Kind::grad ? "grad" : "weight");
    if (li.kind == LKind::unary || li.kind == LKind::binary || li.kind == LKind::ternary)
      s.append(".").append(op_name(li.op));
    for (int k = 0; k < li.num_src; ++k) s += (k ? ", " : " ") + operand_text(li.src[k]);
    s += "\n";
  }
  s += std::string("slots: ").append(std::to_string(lowered.num_slots)) + "\n";
  return s;
}

StreamUse stream_use(const Program& p) {
  StreamUse u;
  for (int i = 0; i < p.num_instrs; ++i) {
    if (p.code[i].op == Op::load) u.loads[p.code[i].attr] = true;
    if (p.code[i].op == Op::store) u.stores[p.code[i].attr] = true;
  }
  return u;
}

PhaseStreamUse phase_stream_use(const Program& p) {
  PhaseStreamUse u;
  for (int part = 0; part < 2; ++part) u.part[part] = stream_use(phase_program(p, part));
  return u;
}

}  // namespace stepfuse::jit
