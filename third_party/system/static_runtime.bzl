"""Link options that make a binary carry absl, protobuf and libstdc++ itself."""

# STATIC_RUNTIME_LINKOPTS go in a cc_binary's own `linkopts` (//imgtool:imgtool):
# Bazel puts those before its deps' (@system//:absl's -labsl_..., -lprotobuf),
# so these static archives resolve every symbol and --as-needed then drops the
# shared copies named after them; --exclude-libs,ALL keeps the archives'
# symbols out of the dynamic symbol table (else the dropped libraries'
# references export thousands of them: 600 KB of .dynstr, 1 MiB more RSS).
# The tests keep the shared libraries.
#
# Why (imgtool info, 2 CPUs): with the ~50 shared absl libraries, libprotobuf
# and libstdc++ a command spent about 5 ms in the dynamic loader and peaked at
# 9.1 MiB RSS (libprotobuf.so 2.2 MiB of it, libstdc++.so 1.5 MiB, and every
# library's relocated pages); linked statically (only what is used, with
# --gc-sections) 5.5 MiB, against qemu-img's 7.8 MiB. libc and libm stay shared.
# Debian ships the archives below in the same -dev packages as the shared
# libraries (tools/setup.sh), built as position-independent code.
STATIC_RUNTIME_LINKOPTS = [
    "-static-libgcc",
    "-Wl,--as-needed",
    "-Wl,--exclude-libs,ALL",
    "-l:libprotobuf.a",
    "-l:libz.a",
    "-l:libzstd.a",
    "-l:libaio.a",
    "-l:liburing.a",
    "-l:libabsl_statusor.a",
    "-l:libabsl_status.a",
    "-l:libabsl_strerror.a",
    "-l:libabsl_flags_parse.a",
    "-l:libabsl_flags_usage.a",
    "-l:libabsl_flags_usage_internal.a",
    "-l:libabsl_flags_internal.a",
    "-l:libabsl_flags_marshalling.a",
    "-l:libabsl_str_format_internal.a",
    "-l:libabsl_flags_reflection.a",
    "-l:libabsl_flags_private_handle_accessor.a",
    "-l:libabsl_flags_commandlineflag.a",
    "-l:libabsl_flags_commandlineflag_internal.a",
    "-l:libabsl_flags_config.a",
    "-l:libabsl_flags_program_name.a",
    "-l:libabsl_cord.a",
    "-l:libabsl_cordz_info.a",
    "-l:libabsl_cord_internal.a",
    "-l:libabsl_cordz_functions.a",
    "-l:libabsl_cordz_handle.a",
    "-l:libabsl_raw_hash_set.a",
    "-l:libabsl_hashtablez_sampler.a",
    "-l:libabsl_exponential_biased.a",
    "-l:libabsl_synchronization.a",
    "-l:libabsl_graphcycles_internal.a",
    "-l:libabsl_stacktrace.a",
    "-l:libabsl_symbolize.a",
    "-l:libabsl_debugging_internal.a",
    "-l:libabsl_demangle_internal.a",
    "-l:libabsl_malloc_internal.a",
    "-l:libabsl_time.a",
    "-l:libabsl_civil_time.a",
    "-l:libabsl_time_zone.a",
    "-l:libabsl_hash.a",
    "-l:libabsl_city.a",
    "-l:libabsl_strings.a",
    "-l:libabsl_strings_internal.a",
    "-l:libabsl_throw_delegate.a",
    "-l:libabsl_bad_optional_access.a",
    "-l:libabsl_bad_variant_access.a",
    "-l:libabsl_low_level_hash.a",
    "-l:libatomic.a",
    "-l:libabsl_base.a",
    "-l:libabsl_raw_logging_internal.a",
    "-l:libabsl_log_severity.a",
    "-l:libabsl_spinlock_wait.a",
    "-l:libabsl_int128.a",
    "-l:libstdc++.a",
]
