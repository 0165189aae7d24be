// Memory-bandwidth probe behind the block-buffer experiment (docs/performance.md): one core,
// 1 GiB, GB/s of glibc memcpy, read-only (1 / 4 streams), non-temporal write-only, a
// non-temporal copy (1 / 4 streams), and a plain copy through an L2 buffer in two phases
// (read a block into the buffer, then stream it out), with and without the next blocks'
// T1 prefetch (tp_pf: block size, distance in blocks, percent prefetched during phase A) and
// pipelined (pipe: the next block's phase A interleaved with this block's phase B; pipe1: the
// same with one read stream instead of four). No transposes: an upper bound for the buffer.
//   g++ -O2 -mavx512f -mavx512bw benchmarks/block_buffer_probe.cpp -o /tmp/probe && /tmp/probe
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
using u8 = unsigned char;
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
__attribute__((target("avx512f"))) __m512i read1(const u8* s, size_t n){ __m512i acc=_mm512_setzero_si512(); for(size_t i=0;i<n;i+=64) acc=_mm512_xor_si512(acc,_mm512_load_si512(s+i)); return acc;}
__attribute__((target("avx512f"))) __m512i read4(const u8* s, size_t n){ __m512i acc=_mm512_setzero_si512(); size_t q=n/4; for(size_t o=0;o<q;o+=512) for(int k=0;k<4;k++) for(int i=0;i<512;i+=64) acc=_mm512_xor_si512(acc,_mm512_load_si512(s+k*q+o+i)); return acc;}
__attribute__((target("avx512f"))) void write1(u8* d, size_t n){ __m512i v=_mm512_set1_epi32(1); for(size_t i=0;i<n;i+=64) _mm512_stream_si512((__m512i*)(d+i),v); _mm_sfence();}
__attribute__((target("avx512f"))) void copy4(u8* d,const u8* s, size_t n){ size_t q=n/4; for(size_t o=0;o<q;o+=512) for(int k=0;k<4;k++) for(int i=0;i<512;i+=64) _mm512_stream_si512((__m512i*)(d+k*q+o+i),_mm512_load_si512(s+k*q+o+i)); _mm_sfence();}
__attribute__((target("avx512f"))) void copy1(u8* d,const u8* s, size_t n){ for(size_t i=0;i<n;i+=64) _mm512_stream_si512((__m512i*)(d+i),_mm512_load_si512(s+i)); _mm_sfence();}
// read 64K blocks into L2 buffer (regular), then NT write from buffer
__attribute__((target("avx512f"))) void twophase(u8* d,const u8* s, size_t n, u8* buf, size_t B){ for(size_t o=0;o<n;o+=B){ for(size_t i=0;i<B;i+=64) _mm512_store_si512(buf+i,_mm512_load_si512(s+o+i)); copy4(d+o,buf,B);} }

// phase B with T1 prefetch of `pf` (B bytes) spread over its slices; phase A prefetches fraction fa of it first
__attribute__((target("avx512f"))) void tp_pf(u8* d,const u8* s, size_t n, u8* buf, size_t B, int dist, int fa_pct){
  for(size_t o=0;o<n;o+=B){
    const u8* p = s + o + dist*B; bool ok = o + dist*B + B <= n;
    size_t pa = ok ? B*fa_pct/100/64*64 : 0; size_t pb = ok ? B - pa : 0;
    // phase A: copy with prefetch of first pa bytes spread
    size_t steps = B/64, pl = 0;
    for(size_t i=0;i<B;i+=64){ _mm512_store_si512(buf+i,_mm512_load_si512(s+o+i)); size_t want=(i/64+1)*pa/steps; while(pl<want){ __builtin_prefetch(p+pl,0,2); pl+=64;} }
    size_t q=B/4; size_t slices=q/512, done=0; pl=0;
    for(size_t oo=0;oo<q;oo+=512){ size_t want=(++done)*pb/slices/64*64; while(pl<want){ __builtin_prefetch(p+pa+pl,0,2); pl+=64;}
      for(int k=0;k<4;k++) for(int i=0;i<512;i+=64) _mm512_stream_si512((__m512i*)(d+o+k*q+oo+i),_mm512_load_si512(buf+k*q+oo+i)); }
  }
  _mm_sfence();
}

// pipelined: phase A of block i+1 (copy into buf[(i+1)%2]) interleaved slice by slice with phase B of block i
__attribute__((target("avx512f"))) void tp_pipe(u8* d,const u8* s, size_t n, u8* buf, size_t B, int pfdist){
  u8* bf[2]={buf, buf+B};
  for(size_t i=0;i<B;i+=64) _mm512_store_si512(bf[0]+i,_mm512_load_si512(s+i));
  size_t q=B/4;
  for(size_t o=0;o<n;o+=B){
    u8* cur=bf[(o/B)&1]; u8* nx=bf[((o/B)+1)&1]; bool more = o+B<n; const u8* ns=s+o+B;
    const u8* p = s + o + (1+pfdist)*B; bool ok = pfdist>0 && o+(1+pfdist)*B+B<=n;
    for(size_t oo=0;oo<q;oo+=512){
      if(more) for(int k=0;k<4;k++){ if(ok) for(int i=0;i<512;i+=64) __builtin_prefetch(p+k*q+oo+i,0,2);
         for(int i=0;i<512;i+=64) _mm512_store_si512(nx+k*q+oo+i,_mm512_load_si512(ns+k*q+oo+i)); }
      for(int k=0;k<4;k++) for(int i=0;i<512;i+=64) _mm512_stream_si512((__m512i*)(d+o+k*q+oo+i),_mm512_load_si512(cur+k*q+oo+i)); }
  }
  _mm_sfence();
}

// pipelined, phase A reads ONE stream (2 KiB per step), writes buffer sequentially
__attribute__((target("avx512f"))) void tp_pipe1(u8* d,const u8* s, size_t n, u8* buf, size_t B){
  u8* bf[2]={buf, buf+B};
  for(size_t i=0;i<B;i+=64) _mm512_store_si512(bf[0]+i,_mm512_load_si512(s+i));
  size_t q=B/4;
  for(size_t o=0;o<n;o+=B){
    u8* cur=bf[(o/B)&1]; u8* nx=bf[((o/B)+1)&1]; bool more = o+B<n; const u8* ns=s+o+B;
    for(size_t oo=0;oo<q;oo+=512){
      if(more) for(int i=0;i<2048;i+=64) _mm512_store_si512(nx+oo*4+i,_mm512_load_si512(ns+oo*4+i));
      for(int k=0;k<4;k++) for(int i=0;i<512;i+=64) _mm512_stream_si512((__m512i*)(d+o+k*q+oo+i),_mm512_load_si512(cur+k*q+oo+i)); }
  }
  _mm_sfence();
}
int main(){ size_t n=1ull<<30; u8*s=(u8*)aligned_alloc(64,n); u8*d=(u8*)aligned_alloc(64,n); memset(s,1,n); memset(d,2,n); u8* buf=(u8*)aligned_alloc(64,1<<20); memset(buf,0,1<<20);
 volatile int sink=0;
 for(int rep=0;rep<3;rep++){
  double t=now(); memcpy(d,s,n); double tm=now()-t;
  t=now(); auto a=read1(s,n); double r1=now()-t; sink+=_mm512_reduce_add_epi32(a);
  t=now(); a=read4(s,n); double r4=now()-t; sink+=_mm512_reduce_add_epi32(a);
  t=now(); write1(d,n); double w1=now()-t;
  t=now(); copy1(d,s,n); double c1=now()-t;
  t=now(); copy4(d,s,n); double c4=now()-t;
  t=now(); twophase(d,s,n,buf,65536); double tp=now()-t;
  t=now(); twophase(d,s,n,buf,524288); double tp2=now()-t;
  double tv[8]; int cfg[8][3]={{65536,1,50},{65536,1,0},{65536,2,50},{65536,2,0},{524288,1,50},{524288,1,0},{65536,4,50},{16384,4,50}};
  for(int c=0;c<8;c++){ t=now(); tp_pf(d,s,n,buf,cfg[c][0],cfg[c][1],cfg[c][2]); tv[c]=now()-t; }
  for(int c=0;c<8;c++) printf("[B=%dK dist=%d fa=%d] %.1f  ", cfg[c][0]/1024,cfg[c][1],cfg[c][2], n/tv[c]/1e9); printf("\n");
  { int cf[6][2]={{16384,0},{16384,1},{65536,0},{65536,1},{262144,0},{262144,1}}; for(int c=0;c<6;c++){ t=now(); tp_pipe(d,s,n,buf,cf[c][0],cf[c][1]); double x=now()-t; printf("pipe[B=%dK pf=%d] %.1f  ",cf[c][0]/1024,cf[c][1],n/x/1e9);} printf("\n"); }
  { size_t cf[3]={16384,65536,262144}; for(int c=0;c<3;c++){ t=now(); tp_pipe1(d,s,n,buf,cf[c]); double x=now()-t; printf("pipe1[B=%zuK] %.1f  ",cf[c]/1024,n/x/1e9);} printf("\n"); }
  printf("GB/s memcpy %.1f read1 %.1f read4 %.1f ntwrite %.1f copy1 %.1f copy4 %.1f twophase64K %.1f twophase512K %.1f\n", n/tm/1e9,n/r1/1e9,n/r4/1e9,n/w1/1e9,n/c1/1e9,n/c4/1e9,n/tp/1e9,n/tp2/1e9);
 }
}
