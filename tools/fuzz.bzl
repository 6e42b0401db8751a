"""imgtool_fuzzer(): a libFuzzer target and the test replaying its corpus."""

def imgtool_fuzzer(name, srcs, corpus, deps = [], **kwargs):
    """Declares `name` (NAME_fuzzer) and `name`_corpus_test.

    `name` is a cc_binary tagged "fuzz" defining LLVMFuzzerTestOneInput. Under
    --config=fuzz it links libFuzzer (-fsanitize=fuzzer) and runs as any
    libFuzzer binary (tools/fuzz.sh); otherwise it links
    //tools:fuzz_replay_main and runs each input file given once.
    `name`_corpus_test runs every file of `corpus` (a filegroup) through the
    target in `bazel test`, in any configuration: the seed corpus and the
    findings kept in it are a regression suite.
    """
    native.cc_binary(
        name = name,
        testonly = True,
        srcs = srcs,
        deps = deps + select({
            "//tools:fuzz_build": [],
            "//conditions:default": ["//tools:fuzz_replay_main"],
        }),
        linkopts = select({
            "//tools:fuzz_build": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        tags = ["fuzz"],
        **kwargs
    )
    native.cc_test(
        name = name + "_corpus_test",
        size = "small",
        srcs = srcs,
        deps = deps + ["//tools:fuzz_replay_main"],
        data = [corpus],
        args = ["$(rootpaths %s)" % corpus],
        **kwargs
    )
