/* One core's read bandwidth over 512 MiB in three kinds of pages: a file mapped read-only (as an embedded
 * library's weights are: 4 KiB page-cache pages), anonymous memory in 4 KiB pages (MADV_NOHUGEPAGE) and
 * anonymous memory in transparent huge pages (MADV_HUGEPAGE). Session 31 asked whether weights streamed from
 * huge pages would read faster (bench/RESULTS.md, session 31): they did not.
 *
 *   dd if=/dev/urandom of=/tmp/s31/big.bin bs=1M count=512
 *   cc -O2 -mavx512f -o /tmp/page_size_read bench/page_size_read.c && /tmp/page_size_read
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static float sum(const float*p,size_t n){__m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
 for(size_t i=0;i<n;i+=64){a0=_mm512_add_ps(a0,_mm512_load_ps(p+i));a1=_mm512_add_ps(a1,_mm512_load_ps(p+i+16));a2=_mm512_add_ps(a2,_mm512_load_ps(p+i+32));a3=_mm512_add_ps(a3,_mm512_load_ps(p+i+48));}
 return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));}
int main(int argc,char**argv){size_t sz=(size_t)512<<20;size_t n=sz/4;
 // file-backed
 int fd=open("/tmp/s31/big.bin",O_RDONLY);float*f=mmap(0,sz,PROT_READ,MAP_PRIVATE,fd,0);
 if(argc>1 && !strcmp(argv[1],"collapse")){int r=madvise(f,sz,25/*MADV_COLLAPSE*/);printf("collapse rc %d\n",r);}
 float*h=mmap(0,sz+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);h=(float*)(((size_t)h+(2<<20)-1)&~((size_t)(2<<20)-1));
 madvise(h,sz,MADV_HUGEPAGE);memcpy(h,f,sz);
 float*s=mmap(0,sz,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);madvise(s,sz,MADV_NOHUGEPAGE);memcpy(s,f,sz);
 volatile float x=0;
 for(int r=0;r<5;r++){double t0=now();x+=sum(f,n);double t1=now();x+=sum(s,n);double t2=now();x+=sum(h,n);double t3=now();
  printf("file4k %.1f GB/s  anon4k %.1f GB/s  anonTHP %.1f GB/s\n",sz/(t1-t0)/1e9,sz/(t2-t1)/1e9,sz/(t3-t2)/1e9);}
 return 0;}
