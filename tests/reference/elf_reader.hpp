// What the tests read from ELF64 images (CUBINs, and the LLVM backend's objects): the
// header, the symbols and the relocation types, every offset bounds-checked, so a bad
// image is a test failure, never a crash. Header-only; <elf.h> only, so it works in
// builds without LLVM.
#pragma once

#include <elf.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace stepfuse::ref {

struct ElfSymbol {
  std::string name;
  unsigned char bind = 0;   // STB_*
  unsigned char type = 0;   // STT_*
  std::uint16_t shndx = 0;  // SHN_UNDEF: undefined
};

struct ElfImage {
  std::string problem;  // empty when the image parsed; then the fields below are complete
  std::uint16_t type = 0;  // ET_*
  std::uint16_t machine = 0;  // EM_*
  std::uint32_t flags = 0;
  std::vector<ElfSymbol> symbols;  // of every SHT_SYMTAB section in order, without their null entries
  std::vector<std::uint32_t> relocation_types;  // ELF64_R_TYPE of every SHT_RELA entry in order

  // Defined global functions, in symbol table order.
  std::vector<std::string> global_functions() const {
    std::vector<std::string> out;
    for (const ElfSymbol& s : symbols)
      if (s.bind == STB_GLOBAL && s.type == STT_FUNC && s.shndx != SHN_UNDEF) out.push_back(s.name);
    return out;
  }
  // Named undefined symbols (what the image needs from elsewhere), in symbol table order.
  std::vector<std::string> undefined() const {
    std::vector<std::string> out;
    for (const ElfSymbol& s : symbols)
      if (s.shndx == SHN_UNDEF && !s.name.empty()) out.push_back(s.name);
    return out;
  }
};

// Parses a little-endian ELF64 image (this host's byte order: the images come from it).
inline ElfImage read_elf(std::string_view img) {
  ElfImage out;
  const auto in_bounds = [&](std::uint64_t off, std::uint64_t size) {
    return off <= img.size() && size <= img.size() - off;
  };
  const auto fail = [&](const char* why) {
    out.problem = why;
    return out;
  };
  // A T at `off` (checked by the caller).
  const auto at = [&]<class T>(std::uint64_t off, T& v) { std::memcpy(&v, img.data() + off, sizeof v); };

  if (img.size() < sizeof(Elf64_Ehdr) || img.compare(0, 4, "\x7f" "ELF") != 0) return fail("no ELF magic");
  if (img[EI_CLASS] != ELFCLASS64) return fail("not ELF64");
  if (img[EI_DATA] != ELFDATA2LSB) return fail("not little-endian");
  Elf64_Ehdr eh;
  at(0, eh);
  out.type = eh.e_type;
  out.machine = eh.e_machine;
  out.flags = eh.e_flags;
  if (eh.e_shnum > 0 && (eh.e_shentsize != sizeof(Elf64_Shdr) ||
                         !in_bounds(eh.e_shoff, std::uint64_t{eh.e_shnum} * sizeof(Elf64_Shdr))))
    return fail("bad section header table");
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  for (std::size_t i = 0; i < sections.size(); ++i) at(eh.e_shoff + i * sizeof(Elf64_Shdr), sections[i]);

  for (const Elf64_Shdr& s : sections) {
    if (s.sh_type == SHT_RELA) {
      if (!in_bounds(s.sh_offset, s.sh_size)) return fail("bad relocation section");
      for (std::uint64_t k = 0; k < s.sh_size / sizeof(Elf64_Rela); ++k) {
        Elf64_Rela r;
        at(s.sh_offset + k * sizeof r, r);
        out.relocation_types.push_back(static_cast<std::uint32_t>(ELF64_R_TYPE(r.r_info)));
      }
    }
    if (s.sh_type != SHT_SYMTAB) continue;
    if (s.sh_entsize != sizeof(Elf64_Sym) || s.sh_link >= sections.size() || !in_bounds(s.sh_offset, s.sh_size))
      return fail("bad symbol table");
    const Elf64_Shdr& strtab = sections[s.sh_link];
    if (!in_bounds(strtab.sh_offset, strtab.sh_size)) return fail("bad string table");
    const std::string_view names = img.substr(strtab.sh_offset, strtab.sh_size);
    for (std::uint64_t k = 1; k < s.sh_size / sizeof(Elf64_Sym); ++k) {  // 0: the null symbol
      Elf64_Sym sym;
      at(s.sh_offset + k * sizeof sym, sym);
      if (sym.st_name >= names.size() && sym.st_name != 0) return fail("symbol name out of range");
      const std::string_view rest = names.substr(std::min<std::size_t>(sym.st_name, names.size()));
      out.symbols.push_back({std::string(rest.substr(0, rest.find('\0'))),
                             static_cast<unsigned char>(ELF64_ST_BIND(sym.st_info)),
                             static_cast<unsigned char>(ELF64_ST_TYPE(sym.st_info)), sym.st_shndx});
    }
  }
  return out;
}

}  // namespace stepfuse::ref
