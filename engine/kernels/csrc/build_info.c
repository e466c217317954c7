// What this build of the kernels was compiled for (engine/kernels/build.py `built_for`): the
// -march it was given and the x86 extensions that let its sources take their wider routes. The
// kernels choose routes by these macros, not by the CPU, so a build for x86-64-v3 runs AVX2 alone.

#ifndef RILL_BUILD_MARCH
#define RILL_BUILD_MARCH "unknown"
#endif

const char *rill_build_march(void) { return RILL_BUILD_MARCH; }

int rill_build_isa(void) {
    int bits = 0;
#ifdef __AVX2__
    bits |= 1;
#endif
#ifdef __FMA__
    bits |= 2;
#endif
#ifdef __AVX512F__
    bits |= 4;
#endif
#ifdef __AVX512VNNI__
    bits |= 8;
#endif
#ifdef __AVX512BF16__
    bits |= 16;
#endif
#ifdef __AMX_TILE__
    bits |= 32;
#endif
#ifdef __AVXVNNI__
    bits |= 64;
#endif
#ifdef __AES__  // beyond x86-64-v3, in every AVX2 CPU's native build: which of the two a build is
    bits |= 128;
#endif
    return bits;
}
