// AMX tile configuration shared by the kernels that run on the tiles (gemm_amx.cpp,
// prefill_attention.cpp through attention_amx.h). A tile register holds up to 16 rows of 64
// bytes; which rows each of tiles 0-7 has is set by one LDTILECFG, which every caller loads
// at the start of its work on a thread (other code on the thread, oneDNN's, loads its own)
// and releases (TILERELEASE) at its end.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__x86_64__)
#include <immintrin.h>

namespace fleetllm::kernels::amx {

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0..7 with rows[t] rows of 64 bytes each (0: the tile stays unconfigured).
__attribute__((target("amx-tile"))) inline void load_config(const uint8_t (&rows)[8],
                                                           TileConfig &cfg)
{
    cfg = TileConfig{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) inline void release() { _tile_release(); }

}  // namespace fleetllm::kernels::amx
#endif
