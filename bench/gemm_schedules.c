/* The float32 MatMul register tile (8 x 48, as bench/gemm_ukernel.c) over a whole M x K x N product in three
 * schedules, to tell whether the order in which Cuvil walks panels and rows (src/cuvil/targets/x86/matmul.py) is
 * what keeps BERT's dense layers below the tile's ceiling. Weights packed as Cuvil packs them (N / 48 panels of
 * K x 48 floats), A read in place (M rows of K floats), C stored; thread CPU time, median of 15 runs.
 *
 *   cc -O3 -march=native bench/gemm_schedules.c -o /tmp/gemm_schedules
 *   /tmp/gemm_schedules M K N VARIANT [KC [NP [PREFETCH_ROWS]]]     # e.g. 128 3072 768 0
 *
 * VARIANT 0: Cuvil's order (panel outer, row tiles inner, all of K, the next panel prefetched into L2);
 *         1: MLAS's blocking (NP panels x KC rows of k a block, row tiles, panels inner: A's slice stays in L1);
 *         2: k blocks of KC outermost, then panels, row tiles inner (a KC x 48 slice of the panel in L1);
 *         3: Cuvil's order with each row tile of A packed k-major first (the packing timed in);
 *         4: panel outer, k blocks of KC, row tiles inner;
 *         5: Cuvil's order with the next panel's prefetch spread evenly over all row tiles of the current panel
 *            (matmul.py NEXT_PANEL_SPREAD), not fetched whole by the first three (variant 0: line t % 3 of each row).
 * Set COLD=1 to read a 512 MiB buffer before each run (no operand cached), and WARMAC=1 with it to read A and
 * write C again after that (only the weights cold, as in a model whose activations stay cached). Needs AVX-512F. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double cpu_now(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define NR 48
/* one tile: 8 rows x 48 over k in [k0,k1); acc loaded from out if load */
__attribute__((noinline)) static void tile(const float *w, const float *a, long lda, long k0, long k1, float *out, long ldo,
   int load, long pf, const float *next, long nline) {
  __m512 c[24];
  if (load) for (int r=0;r<8;r++) for(int v=0;v<3;v++) c[3*r+v]=_mm512_loadu_ps(out+r*ldo+16*v);
  else for (int i=0;i<24;i++) c[i]=_mm512_setzero_ps();
  for (long k=k0;k<k1;k++){
    if (pf) for(int l=0;l<3;l++) _mm_prefetch((const char*)(w+(k+pf)*NR+16*l),_MM_HINT_T0);
    if (next) _mm_prefetch((const char*)(next+k*NR+16*nline),_MM_HINT_T1);
    __m512 b0=_mm512_loadu_ps(w+k*NR),b1=_mm512_loadu_ps(w+k*NR+16),b2=_mm512_loadu_ps(w+k*NR+32);
    for(int r=0;r<8;r++){__m512 s=_mm512_set1_ps(a[r*lda+k]);
      c[3*r]=_mm512_fmadd_ps(s,b0,c[3*r]);c[3*r+1]=_mm512_fmadd_ps(s,b1,c[3*r+1]);c[3*r+2]=_mm512_fmadd_ps(s,b2,c[3*r+2]);}
  }
  for (int r=0;r<8;r++) for(int v=0;v<3;v++) _mm512_storeu_ps(out+r*ldo+16*v,c[3*r+v]);
}
/* packed-A tile: ap[k*8+r] */
__attribute__((noinline)) static void tilep(const float *w, const float *ap, long k0, long k1, float *out, long ldo,
   int load, long pf, const float *next, long nline) {
  __m512 c[24];
  if (load) for (int r=0;r<8;r++) for(int v=0;v<3;v++) c[3*r+v]=_mm512_loadu_ps(out+r*ldo+16*v);
  else for (int i=0;i<24;i++) c[i]=_mm512_setzero_ps();
  for (long k=k0;k<k1;k++){
    if (pf) for(int l=0;l<3;l++) _mm_prefetch((const char*)(w+(k+pf)*NR+16*l),_MM_HINT_T0);
    if (next) _mm_prefetch((const char*)(next+k*NR+16*nline),_MM_HINT_T1);
    __m512 b0=_mm512_loadu_ps(w+k*NR),b1=_mm512_loadu_ps(w+k*NR+16),b2=_mm512_loadu_ps(w+k*NR+32);
    for(int r=0;r<8;r++){__m512 s=_mm512_set1_ps(ap[k*8+r]);
      c[3*r]=_mm512_fmadd_ps(s,b0,c[3*r]);c[3*r+1]=_mm512_fmadd_ps(s,b1,c[3*r+1]);c[3*r+2]=_mm512_fmadd_ps(s,b2,c[3*r+2]);}
  }
  for (int r=0;r<8;r++) for(int v=0;v<3;v++) _mm512_storeu_ps(out+r*ldo+16*v,c[3*r+v]);
}
static long M,K,N,P,T,KC,NP,PF=32;
/* tile whose k-loop prefetches `count` lines of `next` starting at line `first`, spread over the K steps */
__attribute__((noinline)) static void tile5(const float *w, const float *a, long lda, long k0, long k1, float *out, long ldo,
   long pf, const float *next, long first, long count) {
  __m512 c[24];
  for (int i=0;i<24;i++) c[i]=_mm512_setzero_ps();
  unsigned long step = next ? (unsigned long)((count << 32) / (k1 - k0)) : 0, acc = 0;
  for (long k=k0;k<k1;k++){
    if (pf) for(int l=0;l<3;l++) _mm_prefetch((const char*)(w+(k+pf)*NR+16*l),_MM_HINT_T0);
    if (next) _mm_prefetch((const char*)(next+(first+(acc>>32))*16),_MM_HINT_T1);
    acc += step;
    __m512 b0=_mm512_loadu_ps(w+k*NR),b1=_mm512_loadu_ps(w+k*NR+16),b2=_mm512_loadu_ps(w+k*NR+32);
    for(int r=0;r<8;r++){__m512 s=_mm512_set1_ps(a[r*lda+k]);
      c[3*r]=_mm512_fmadd_ps(s,b0,c[3*r]);c[3*r+1]=_mm512_fmadd_ps(s,b1,c[3*r+1]);c[3*r+2]=_mm512_fmadd_ps(s,b2,c[3*r+2]);}
  }
  for (int r=0;r<8;r++) for(int v=0;v<3;v++) _mm512_storeu_ps(out+r*ldo+16*v,c[3*r+v]);
}
static float *A,*W,*C,*AP;
static void run(int var){
  if(var==0){ /* cuvil: panel outer, row tiles inner, full K, next panel prefetch */
    for(long p=0;p<P;p++) for(long t=0;t<T;t++)
      tile(W+p*K*NR,A+t*8*K,K,0,K,C+t*8*N+p*NR,N,0,PF,p+1<P?W+(p+1)*K*NR:0,t%3);
  } else if(var==1){ /* MLAS-like: n-block of NP panels, k-block KC, row tiles, panels inner */
    for(long nb=0;nb<P;nb+=NP) for(long kb=0;kb<K;kb+=KC){long k1=kb+KC<K?kb+KC:K;
      for(long t=0;t<T;t++) for(long p=nb;p<nb+NP&&p<P;p++)
        tile(W+p*K*NR,A+t*8*K,K,kb,k1,C+t*8*N+p*NR,N,kb>0,PF,0,0);}
  } else if(var==2){ /* k-block KC outer, panel, row tiles inner (B micro panel in L1) */
    for(long kb=0;kb<K;kb+=KC){long k1=kb+KC<K?kb+KC:K;
      for(long p=0;p<P;p++) for(long t=0;t<T;t++)
        tile(W+p*K*NR,A+t*8*K,K,kb,k1,C+t*8*N+p*NR,N,kb>0,PF,0,0);}
  } else if(var==3){ /* cuvil order with packed A (packing counted) */
    for(long t=0;t<T;t++) for(long k=0;k<K;k++) for(int r=0;r<8;r++) AP[t*8*K+k*8+r]=A[(t*8+r)*K+k];
    for(long p=0;p<P;p++) for(long t=0;t<T;t++)
      tilep(W+p*K*NR,AP+t*8*K,0,K,C+t*8*N+p*NR,N,0,PF,p+1<P?W+(p+1)*K*NR:0,t%3);
  } else if(var==5){ /* cuvil order, the next panel's prefetch spread over all row tiles of this panel */
    long lines=K*3;
    for(long p=0;p<P;p++) for(long t=0;t<T;t++)
      tile5(W+p*K*NR,A+t*8*K,K,0,K,C+t*8*N+p*NR,N,PF,p+1<P?W+(p+1)*K*NR:0,t*lines/T,((t+1)*lines/T-t*lines/T));
  } else if(var==4){ /* panel outer, k-block, row tiles inner: B slice KCx48 in L1, acc via C */
    for(long p=0;p<P;p++) for(long kb=0;kb<K;kb+=KC){long k1=kb+KC<K?kb+KC:K;
      for(long t=0;t<T;t++) tile(W+p*K*NR,A+t*8*K,K,kb,k1,C+t*8*N+p*NR,N,kb>0,PF,0,0);}
  }
}
int main(int argc,char**argv){
  if (argc < 5) { fprintf(stderr, "usage: %s M K N VARIANT [KC [NP [PREFETCH_ROWS]]] (M a multiple of 8, N of 48)\n", argv[0]); return 2; }
  M=atol(argv[1]);K=atol(argv[2]);N=atol(argv[3]);int var=atoi(argv[4]);KC=argc>5?atol(argv[5]):256;NP=argc>6?atol(argv[6]):4;
  if(argc>7)PF=atol(argv[7]);
  P=N/NR;T=M/8;
  A=aligned_alloc(64,M*K*4);W=aligned_alloc(64,(P*K+PF+8)*NR*4);C=aligned_alloc(64,M*N*4);AP=aligned_alloc(64,M*K*4);
  for (long i = 0; i < M * K; i++) A[i] = 1e-3f * (i % 5);
  for (long i = 0; i < (P * K + PF + 8) * NR; i++) W[i] = 1e-3f * (i % 7);
  /* flush buffer */
  long FL=512L<<20; char*fl=malloc(FL); memset(fl,1,FL);
  double fl_ops=2.0*M*N*K; double ts[15];int R=15; volatile long sink=0;
  for(int r=0;r<R;r++){ if(getenv("COLD")) {for(long i=0;i<FL;i+=64) sink+=fl[i]; if(getenv("WARMAC")){for(long i=0;i<M*K;i+=16) sink+=(long)A[i]; for(long i=0;i<M*N;i+=16) C[i]=0;}}
    double t0=cpu_now(); run(var); ts[r]=cpu_now()-t0;}
  /* median */
  for(int i=0;i<R;i++)for(int j=i+1;j<R;j++)if(ts[j]<ts[i]){double x=ts[i];ts[i]=ts[j];ts[j]=x;}
  printf("M=%ld K=%ld N=%ld var=%d KC=%ld NP=%ld: p50 %.3f ms %.1f GFLOP/s (min %.1f) chk %g\n",M,K,N,var,KC,NP,ts[R/2]*1e3,fl_ops/ts[R/2]/1e9,fl_ops/ts[0]/1e9,C[77]);
  return 0;}
