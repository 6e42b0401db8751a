#include "block/registry.h"

#include <sys/stat.h>
#include <sys/xattr.h>

#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/options.h"
#include "posix_file/file_node.h"
#include "gtest/gtest.h"
#include "io/engine.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::block {
namespace {

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

NodeOptions Opts(const std::string& text) {
  absl::StatusOr<NodeOptions> options =
      ImageOptions(text, "", /*image_opts=*/true);
  EXPECT_TRUE(options.ok()) << options.status();
  return options.ok() ? *options : NodeOptions{};
}

TEST(RegistryTest, KnowsQemusDriverNames) {
  EXPECT_EQ(DriverNames(),
            (std::vector<std::string>{"blkdebug", "compress", "copy-on-read",
                                      "file", "host_cdrom", "host_device", "nbd",
                                      "null-aio", "null-co", "preallocate",
                                      "qcow2", "quorum", "raw"}));
  EXPECT_EQ(FindDriver("host_device")->kind, DriverKind::kProtocol);
  EXPECT_EQ(FindDriver("copy-on-read")->kind, DriverKind::kFilter);
  EXPECT_EQ(FindDriver("null-co")->kind, DriverKind::kProtocol);
  EXPECT_EQ(FindDriver("blkdebug")->kind, DriverKind::kProtocol);
  EXPECT_EQ(FindDriver("blkdebug")->file_child_key, "image");
  EXPECT_EQ(FindDriver("preallocate")->kind, DriverKind::kFilter);
  EXPECT_EQ(FindDriver("qcow2")->kind, DriverKind::kFormat);
  EXPECT_EQ(FindDriver("quorum")->kind, DriverKind::kFormat);
  EXPECT_EQ(FindDriver("file")->kind, DriverKind::kProtocol);
  EXPECT_EQ(FindDriver("xyz"), nullptr);
  EXPECT_TRUE(IsUnsupportedQemuDriver("vmdk"));
  EXPECT_FALSE(IsUnsupportedQemuDriver("xyz"));
}

TEST(RegistryTest, FillsOptionsByDashedFieldName) {
  qcow2::Qcow2OpenOptions options;
  ASSERT_TRUE(FillDriverOptions(*FindDriver("qcow2"),
                                Opts("l2-cache-size=64k,refcount-cache-size=1M,"
                                     "lazy-refcounts=on,foo=1"),
                                &options)
                  .ok());
  EXPECT_EQ(options.l2_cache_size(), 65536u);
  EXPECT_EQ(options.refcount_cache_size(), 1048576u);
  ASSERT_TRUE(options.has_lazy_refcounts());
  EXPECT_TRUE(options.lazy_refcounts());

  posix_file::FileOpenOptions file;
  ASSERT_TRUE(FillDriverOptions(*FindDriver("file"),
                                Opts("filename=a,,b,locking=off"), &file)
                  .ok());
  EXPECT_EQ(file.filename(), "a,b");
  EXPECT_EQ(file.locking(), "off");
  EXPECT_EQ(file.cache(), "");  // not a user key
}

TEST(RegistryTest, OptionValueErrorsAreQemus) {
  qcow2::Qcow2OpenOptions options;
  EXPECT_EQ(FillDriverOptions(*FindDriver("qcow2"), Opts("l2-cache-size=1x"),
                              &options)
                .message(),
            "Parameter 'l2-cache-size' expects a non-negative number below "
            "2^64\nOptional suffix k, M, G, T, P or E means kilo-, mega-, "
            "giga-, tera-, peta-\nand exabytes, respectively.");
  EXPECT_EQ(FillDriverOptions(*FindDriver("qcow2"),
                              Opts("lazy-refcounts=maybe"), &options)
                .message(),
            "Parameter 'lazy-refcounts' expects 'on' or 'off'");
  // json:{"lazy-refcounts": true} gives "true".
  EXPECT_TRUE(FillDriverOptions(*FindDriver("qcow2"),
                                Opts("lazy-refcounts=true"), &options)
                  .ok());
}

TEST(RegistryTest, BlkdebugFilenamesNameTheirProtocolNode) {
  NodeOptions o = *ImageOptions("blkdebug:a.conf:dir/x:y.qcow2", "qcow2", false);
  EXPECT_EQ(o.values.at("driver"), "qcow2");
  const NodeOptions& file = o.children.at("file");
  EXPECT_EQ(file.values.at("driver"), "blkdebug");
  EXPECT_EQ(file.values.at("config"), "a.conf");
  EXPECT_EQ(file.values.at("x-image"), "dir/x:y.qcow2");
  EXPECT_EQ(ImageOptions("blkdebug:x.qcow2", "", false).status().message(),
            "blkdebug requires both config file and image path");
  // Not a driver that parses filenames: a plain file name.
  // A prefix no protocol has: QEMU's "Unknown protocol 'foo'".
  EXPECT_EQ(ImageOptions("foo:x.qcow2", "", false).status().message(),
            "Unknown protocol 'foo'");
  NodeOptions plain = *ImageOptions("./foo:x.qcow2", "", false);
  EXPECT_EQ(plain.children.at("file").values.at("filename"), "./foo:x.qcow2");
}

TEST(RegistryTest, PlaceFilenameGoesDownToTheProtocolNode) {
  NodeOptions cor = Opts("driver=copy-on-read,file.driver=qcow2");
  ASSERT_TRUE(PlaceFilename("t.qcow2", &cor).ok());
  const NodeOptions& file = cor.children["file"].children["file"];
  EXPECT_EQ(file.values.at("driver"), "file");
  EXPECT_EQ(file.values.at("filename"), "t.qcow2");

  NodeOptions blkdebug = Opts("driver=blkdebug,config=c,image.driver=qcow2");
  ASSERT_TRUE(PlaceFilename("t.qcow2", &blkdebug).ok());
  EXPECT_EQ(blkdebug.values.at("x-image"), "t.qcow2");

  NodeOptions protocol = Opts("driver=file,locking=off");
  ASSERT_TRUE(PlaceFilename("t.raw", &protocol).ok());
  EXPECT_EQ(protocol.values.at("filename"), "t.raw");

  NodeOptions named = Opts("driver=qcow2,file.filename=a.qcow2");
  ASSERT_TRUE(PlaceFilename("b.qcow2", &named).ok());
  EXPECT_EQ(named.children["file"].values.at("filename"), "a.qcow2");
}

TEST(RegistryTest, FindsTheBottomProtocolNodeAndItsODirect) {
  struct Case {
    std::string options;
    std::string cache;
    bool direct;
    bool posix_file;
    std::string filename;  // of the node found
  };
  const std::vector<Case> cases = {
      {"driver=qcow2,file.driver=file,file.filename=a", "none", true, true,
       "a"},
      {"driver=qcow2,file.driver=file,file.filename=a", "directsync", true,
       true, "a"},
      {"driver=qcow2,file.driver=file,file.filename=a", "writeback", false,
       true, "a"},
      // cache.direct anywhere on the chain; the lowest one given wins.
      {"driver=qcow2,cache.direct=on,file.driver=file,file.filename=a",
       "writeback", true, true, "a"},
      {"driver=qcow2,cache.direct=on,file.driver=file,file.filename=a,"
       "file.cache.direct=off",
       "none", false, true, "a"},
      // A value the open refuses is skipped here.
      {"driver=qcow2,file.driver=file,file.filename=a,file.cache.direct=maybe",
       "none", true, true, "a"},
      {"driver=raw,file.driver=host_device,file.filename=/dev/x", "none", true,
       true, "/dev/x"},
      {"driver=null-co,size=1M", "none", true, false, ""},
      {"driver=raw,file.driver=nbd,file.host=h", "none", true, false, ""},
      // No driver: a plain file name is a file node, a prefixed one not.
      {"driver=raw,file.filename=b", "none", true, true, "b"},
      {"driver=raw,file.filename=nbd://h/x", "none", true, false,
       "nbd://h/x"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.options + " cache=" + c.cache);
    NodeOptions options = Opts(c.options);
    BottomProtocolNode bottom = FindBottomProtocolNode(options, c.cache);
    EXPECT_EQ(bottom.direct, c.direct);
    EXPECT_EQ(bottom.posix_file, c.posix_file);
    auto name = bottom.node->values.find("filename");
    EXPECT_EQ(name == bottom.node->values.end() ? "" : name->second,
              c.filename);
  }
}

TEST(RegistryTest, ImageOptionsOfTheCommandLine) {
  NodeOptions plain = *ImageOptions("x.qcow2", "qcow2", false);
  EXPECT_EQ(plain.values.at("driver"), "qcow2");
  EXPECT_EQ(plain.children.at("file").values.at("driver"), "file");
  EXPECT_EQ(plain.children.at("file").values.at("filename"), "x.qcow2");

  NodeOptions file = *ImageOptions("x.raw", "file", false);
  EXPECT_EQ(file.values.at("driver"), "file");
  EXPECT_EQ(file.values.at("filename"), "x.raw");
  EXPECT_TRUE(file.children.empty());

  NodeOptions probe = *ImageOptions("x.raw", "", false);
  EXPECT_EQ(probe.values.count("driver"), 0u);

  // -f replaces the driver of a json: filename, as in qemu-img.
  NodeOptions json = *ImageOptions(
      R"(json:{"driver":"qcow2","file":{"driver":"file","filename":"x"}})",
      "raw", false);
  EXPECT_EQ(json.values.at("driver"), "raw");
  EXPECT_EQ(json.children.at("file").values.at("filename"), "x");

  // A bare first item is the implied `file` key (a node name).
  NodeOptions bare = *ImageOptions("x.qcow2", "", true);
  EXPECT_EQ(bare.values.at("file"), "x.qcow2");

  EXPECT_EQ(ImageOptions("json:[]", "", false).status().message(),
            "Invalid JSON object given");
}

class OpenGraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir();
    qcow2_ = dir_ + "/reg.qcow2";
    raw_ = dir_ + "/reg.raw";
    overlay_ = dir_ + "/reg_ov.qcow2";
    ASSERT_EQ(std::system(absl::StrCat("qemu-img create -q -f qcow2 ", qcow2_,
                                       " 64M && qemu-img create -q -f raw ",
                                       raw_, " 1M && qemu-img create -q -f "
                                       "qcow2 -b reg.qcow2 -F qcow2 ",
                                       overlay_)
                              .c_str()),
              0);
    absl::StatusOr<std::unique_ptr<io::Engine>> engine =
        io::CreateEngine(io::EngineKind::kAuto, 4, nullptr);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }

  absl::StatusOr<OpenedGraph> Open(const std::string& text,
                                   bool read_only = true,
                                   bool no_backing = false,
                                   bool qcow2_grow_ahead = true) {
    absl::StatusOr<NodeOptions> options =
        ImageOptions(text, "", /*image_opts=*/true);
    if (!options.ok()) return options.status();
    OpenSettings s;
    s.engine = engine_.get();
    s.read_only = read_only;
    s.no_backing = no_backing;
    s.qcow2_grow_ahead = qcow2_grow_ahead;
    s.err = &err_;
    return io::RunSync(*engine_, OpenGraph(*std::move(options), s));
  }

  // The error text of opening `text`, or "ok: <display name> <format>".
  std::string Result(const std::string& text, bool read_only = true) {
    absl::StatusOr<OpenedGraph> g = Open(text, read_only);
    if (!g.ok()) return std::string(g.status().message());
    std::string out = absl::StrCat("ok: ", g->display_name, " ", g->format);
    EXPECT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());
    return out;
  }

  std::string dir_, qcow2_, raw_, overlay_;
  std::unique_ptr<io::Engine> engine_;
  std::ostringstream err_;
};

TEST_F(OpenGraphTest, NamesTheImageAsQemuDoes) {
  const std::string q = qcow2_;
  EXPECT_EQ(Result("driver=qcow2,file.driver=file,file.filename=" + q),
            "ok: " + q + " qcow2");
  // file.filename alone implies the file driver; no driver: probed.
  EXPECT_EQ(Result("driver=qcow2,file.filename=" + q), "ok: " + q + " qcow2");
  EXPECT_EQ(Result("file.filename=" + q), "ok: " + q + " qcow2");
  EXPECT_EQ(Result("file.filename=" + raw_), "ok: " + raw_ + " raw");
  EXPECT_EQ(Result("driver=file,filename=" + q), "ok: " + q + " file");
  // Options that do not change what the file name opens keep the name.
  EXPECT_EQ(Result("driver=qcow2,l2-cache-size=1M,file.locking=off,"
                   "file.filename=" + q),
            "ok: " + q + " qcow2");
  // A format over a format: only JSON rebuilds that graph.
  EXPECT_EQ(Result("driver=qcow2,file.driver=raw,file.file.filename=" + q),
            "ok: json:{\"driver\": \"qcow2\", \"file\": {\"driver\": \"raw\", "
            "\"file\": {\"driver\": \"file\", \"filename\": \"" +
                q + "\"}}} qcow2");
}

TEST_F(OpenGraphTest, PreallocateFilterChains) {
  const std::string q = qcow2_;
  const std::string file_json =
      "{\"driver\": \"file\", \"filename\": \"" + q + "\"}";
  // A filter is never named by its file: always JSON, options left out.
  EXPECT_EQ(Result("driver=qcow2,file.driver=preallocate,file.prealloc-size="
                   "1M,file.prealloc-align=64k,file.file.driver=file,"
                   "file.file.filename=" + q),
            "ok: json:{\"driver\": \"qcow2\", \"file\": {\"driver\": "
            "\"preallocate\", \"file\": " + file_json + "}} qcow2");
  EXPECT_EQ(Result("driver=preallocate,file.filename=" + q),
            "ok: json:{\"driver\": \"preallocate\", \"file\": " +
                file_json + "} preallocate");
  // Probing looks through the filter at the file.
  EXPECT_EQ(Result("file.driver=preallocate,file.file.filename=" + q),
            "ok: json:{\"driver\": \"qcow2\", \"file\": {\"driver\": "
            "\"preallocate\", \"file\": " + file_json + "}} qcow2");

  absl::StatusOr<OpenedGraph> g = Open(
      "driver=qcow2,file.driver=preallocate,file.file.filename=" + q, false);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_NE(g->qcow2, nullptr);
  ASSERT_NE(g->file, nullptr);
  const io::BlockNode* filter = &g->qcow2->file();
  EXPECT_NE(filter, g->file);
  EXPECT_EQ(g->node_names.at(filter),
            "json:{\"driver\": \"preallocate\", \"file\": " + file_json +
                "}");
  EXPECT_EQ(g->node_names.at(g->file), q);
  EXPECT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());

  EXPECT_EQ(Result("driver=preallocate,file.filename=" + q +
                   ",prealloc-align=3"),
            "prealloc-align parameter of preallocate filter is not aligned "
            "to 512");
  EXPECT_EQ(Result("driver=preallocate,file.filename=" + q +
                   ",prealloc-size=3x"),
            "Parameter 'prealloc-size' expects a non-negative number below "
            "2^64\nOptional suffix k, M, G, T, P or E means kilo-, mega-, "
            "giga-, tera-, peta-\nand exabytes, respectively.");
  EXPECT_EQ(Result("driver=preallocate,file.filename=" + q + ",foo=1"),
            "Block format 'preallocate' does not support the option 'foo'");
  EXPECT_EQ(Result("driver=qcow2,file.driver=preallocate,file.filename=" + q),
            "A block device must be specified for \"file\"");
}

// qcow2 over a file keeps the file's length ahead of its allocations while
// open (so that allocating writes at the end run in parallel) and leaves it
// exactly as qemu-io does at close; over the preallocate filter the filter
// alone decides the length.
TEST_F(OpenGraphTest, Qcow2GrowsItsFileAheadAndCutsItAtClose) {
  auto length = [](const std::string& path) -> int64_t {
    struct stat st;
    return stat(path.c_str(), &st) == 0 ? st.st_size : -1;
  };
  const std::string twin = dir_ + "/reg_twin.qcow2";
  ASSERT_EQ(std::system(absl::StrCat("cp ", qcow2_, " ", twin,
                                     " && qemu-io -c 'write -P 0x5a 0 1M' ",
                                     twin, " >/dev/null")
                            .c_str()),
            0);
  const std::vector<uint8_t> data(1 << 20, 0x5a);

  absl::StatusOr<OpenedGraph> g =
      Open("driver=qcow2,file.filename=" + qcow2_, /*read_only=*/false);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(io::RunSync(*engine_, g->node->Write(0, io::ConstIoVec(data)))
                  .ok());
  // The first write past the end grew the file to 1 MiB + 64 MiB.
  EXPECT_EQ(length(qcow2_), int64_t{65} << 20);
  EXPECT_EQ(g->file->size(), static_cast<uint64_t>(length(twin)));
  ASSERT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());
  EXPECT_EQ(length(qcow2_), length(twin));
  EXPECT_EQ(std::system(absl::StrCat("cmp -s ", qcow2_, " ", twin).c_str()),
            0);

  // Without qcow2_grow_ahead (snapshot): the file ends at the data.
  const std::string plain = dir_ + "/reg_plain.qcow2";
  ASSERT_EQ(std::system(absl::StrCat("cp ", qcow2_, " ", plain).c_str()), 0);
  g = Open("driver=qcow2,file.filename=" + plain, /*read_only=*/false,
           /*no_backing=*/false, /*qcow2_grow_ahead=*/false);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(io::RunSync(*engine_,
                          g->node->Write(8 << 20, io::ConstIoVec(data)))
                  .ok());
  EXPECT_EQ(static_cast<uint64_t>(length(plain)), g->file->size());
  EXPECT_LT(length(plain), int64_t{4} << 20);
  ASSERT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());
  EXPECT_EQ(std::system(absl::StrCat("qemu-img check -q ", plain).c_str()), 0);

  // Read-only: nothing grows or shrinks.
  g = Open("driver=qcow2,file.filename=" + qcow2_);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());
  EXPECT_EQ(length(qcow2_), length(twin));

  // Through the filter: its prealloc-size, not the 64 MiB step.
  g = Open("driver=qcow2,file.driver=preallocate,file.prealloc-size=2M,"
           "file.file.filename=" + qcow2_,
           /*read_only=*/false);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(
      io::RunSync(*engine_, g->node->Write(8 << 20, io::ConstIoVec(data)))
          .ok());
  EXPECT_LE(length(qcow2_), int64_t{8} << 20);
  ASSERT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());
}

// A writer killed while its qcow2 file was grown ahead leaves a hole after
// the data, and the file marked; the next read-write open and close cut it,
// never below the last refcounted cluster nor below data. The crash itself
// is simulated with truncate and setxattr; qcow2/testing/crash_test.cc
// covers real kills. An unmarked hole tail (QEMU's discarded last clusters)
// stays, as in QEMU.
TEST_F(OpenGraphTest, Qcow2CutsAHoleTailLeftAfterItsClustersAtClose) {
  auto length = [](const std::string& path) -> int64_t {
    struct stat st;
    return stat(path.c_str(), &st) == 0 ? st.st_size : -1;
  };
  auto sh = [](const std::string& command) {
    return std::system((command + " >/dev/null 2>&1").c_str());
  };
  auto open_close = [&](const std::string& path, bool read_only) {
    absl::StatusOr<OpenedGraph> g =
        Open("driver=qcow2,file.filename=" + path, read_only);
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());
  };
  // What qemu-io leaves: 1 MiB of data, the file ends at its last cluster.
  const std::string twin = dir_ + "/tail_twin.qcow2";
  ASSERT_EQ(sh(absl::StrCat("cp ", qcow2_, " ", twin,
                            " && qemu-io -c 'write -P 0x5a 0 1M' ", twin)),
            0);
  const int64_t data_end = length(twin);
  ASSERT_EQ(data_end, 1376256);  // header, L1, refcounts, L2, 16 clusters

  const std::string img = dir_ + "/tail.qcow2";
  auto mark = [&] {
    ASSERT_EQ(setxattr(img.c_str(), posix_file::kGrownAheadMarker, "1", 1, 0),
              0);
  };
  ASSERT_EQ(sh(absl::StrCat("cp ", twin, " ", img, " && truncate -s +65M ",
                            img)),
            0);
  // Not marked: kept, as QEMU keeps it.
  open_close(img, /*read_only=*/false);
  EXPECT_EQ(length(img), data_end + (int64_t{65} << 20));
  mark();
  // QEMU keeps such a tail for good and cannot preallocate over it.
  EXPECT_NE(sh(absl::StrCat("cp ", img, " ", img, ".q && qemu-img resize "
                            "--preallocation=falloc ", img, ".q +1M")),
            0);
  // Read-only: left alone.
  open_close(img, /*read_only=*/true);
  EXPECT_EQ(length(img), data_end + (int64_t{65} << 20));
  {
    absl::StatusOr<OpenedGraph> g =
        Open("driver=qcow2,file.filename=" + img, /*read_only=*/false);
    ASSERT_TRUE(g.ok()) << g.status();
    // Seen from above, the file ends at the data already.
    EXPECT_EQ(g->file->size(), static_cast<uint64_t>(data_end));
    ASSERT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());
  }
  EXPECT_EQ(length(img), data_end);
  EXPECT_EQ(sh(absl::StrCat("cmp ", img, " ", twin)), 0);
  EXPECT_EQ(sh("qemu-img check " + img), 0);
  EXPECT_EQ(sh("qemu-img resize --preallocation=falloc " + img + " +1M"), 0);

  // Data after the last refcounted cluster (here 64 KiB a failed write
  // left) stays; the hole after it goes.
  ASSERT_EQ(sh(absl::StrCat("cp ", twin, " ", img, " && head -c 64k "
                            "/dev/urandom >>", img, " && truncate -s +65M ",
                            img)),
            0);
  mark();
  open_close(img, /*read_only=*/false);
  EXPECT_EQ(length(img), data_end + 65536);
  EXPECT_EQ(sh(absl::StrCat("cmp -n ", data_end, " ", img, " ", twin)), 0);
  EXPECT_EQ(sh("qemu-img check " + img), 0);

  // preallocation=metadata: every cluster refcounted, nearly all holes;
  // QEMU's file ends at the last cluster and so does it afterwards, also
  // when a hole tail comes after it.
  const std::string meta = dir_ + "/tail_meta.qcow2";
  ASSERT_EQ(sh(absl::StrCat("qemu-img create -q -f qcow2 -o "
                            "preallocation=metadata ", meta, " 100M && cp ",
                            meta, " ", img)),
            0);
  ASSERT_EQ(length(meta), 105185280);  // qemu-img check: image end offset
  open_close(img, /*read_only=*/false);
  EXPECT_EQ(sh(absl::StrCat("cmp ", img, " ", meta)), 0);
  ASSERT_EQ(sh("truncate -s +65M " + img), 0);
  mark();
  open_close(img, /*read_only=*/false);
  EXPECT_EQ(sh(absl::StrCat("cmp ", img, " ", meta)), 0);

  // QEMU discards the last clusters: freed and punched, the file keeps its
  // length. A read-write open and close keep it too.
  ASSERT_EQ(sh(absl::StrCat("cp ", twin, " ", img, " && qemu-io -c 'discard "
                            "512k 512k' ", img, " && cp ", img, " ", img,
                            ".discarded")),
            0);
  open_close(img, /*read_only=*/false);
  EXPECT_EQ(length(img), data_end);
  EXPECT_EQ(sh(absl::StrCat("cmp ", img, " ", img, ".discarded")), 0);
}

TEST_F(OpenGraphTest, ErrorsAreQemus) {
  const std::string q = qcow2_;
  const std::pair<std::string, std::string> cases[] = {
      {"driver=xyz,file.filename=" + q, "Unknown driver 'xyz'"},
      {"driver=qcow2,file.driver=xyz,file.filename=" + q,
       "Unknown driver 'xyz'"},
      {"driver=vmdk,file.filename=" + q, "Format 'vmdk' is not supported yet"},
      {"driver=qcow2,file.filename=" + q + ",foo=1",
       "Block format 'qcow2' does not support the option 'foo'"},
      {"driver=qcow2,file.filename=" + q + ",file.foo=1",
       "Block protocol 'file' doesn't support the option 'foo'"},
      {"driver=qcow2,file.filename=" + q + ",foo.bar=1",
       "Block format 'qcow2' does not support the option 'foo.bar'"},
      {"driver=qcow2,file.filename=" + q + ",cache.foo=1",
       "Block format 'qcow2' does not support the option 'cache.foo'"},
      {"driver=raw,file.filename=" + raw_ + ",foo=1",
       "Block format 'raw' does not support the option 'foo'"},
      {"driver=qcow2,filename=" + q + ",file.filename=" + q,
       "Block format 'qcow2' does not support the option 'filename'"},
      {"driver=qcow2,file.driver=file", "The 'file' block driver requires a "
                                        "file name"},
      {"driver=file,filename=", "The 'file' block driver requires a file name"},
      {"driver=qcow2", "A block device must be specified for \"file\""},
      {"driver=qcow2,filename=" + q,
       "A block device must be specified for \"file\""},
      {"filename=" + q, "Must specify either driver or file"},
      {"", "Must specify either driver or file"},
      {"driver=qcow2,file.locking=off", "Must specify either driver or file"},
      {"x.qcow2", "Cannot find device='x.qcow2' nor node-name='x.qcow2'"},
      {"driver=qcow2,file.filename=" + q + ",l2-cache-size=1x",
       "Parameter 'l2-cache-size' expects a non-negative number below 2^64\n"
       "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, "
       "peta-\nand exabytes, respectively."},
      {"driver=qcow2,file.filename=" + q + ",cache.direct=maybe",
       "Parameter 'cache.direct' expects 'on' or 'off'"},
      {"driver=qcow2,file.filename=" + q + ",file.locking=maybe",
       "invalid parameter value: maybe"},
      // The child's errors come first, the format's before unknown keys.
      {"driver=qcow2,file.filename=" + dir_ + "/nonexist,foo=1",
       "Could not open '" + dir_ + "/nonexist': No such file or directory"},
      {"driver=qcow2,file.filename=" + raw_ + ",foo=1",
       "Image is not in qcow2 format"},
      {"driver=qcow2,file.filename=" + dir_,
       "'file' driver requires '" + dir_ + "' to be a regular file"},
      // A `file` child is a protocol node: a filename or a driver.
      {"driver=qcow2,file.file.filename=" + q,
       "Must specify either driver or file"},
      {"driver=qcow2,file.filename=" + q + ",file.aio=native",
       "aio=native was specified, but it requires cache.direct=on, which "
       "was not specified."},
      {"driver=file,filename=,aio=bad",
       "The 'file' block driver requires a file name"},
      // info opens without backing file: backing options are unknown then.
      {"driver=qcow2,file.filename=" + q + ",backing=foo",
       "Block format 'qcow2' does not support the option 'backing'"},
  };
  for (const auto& [text, error] : cases) {
    absl::StatusOr<OpenedGraph> g =
        Open(text, /*read_only=*/true, /*no_backing=*/true);
    ASSERT_FALSE(g.ok()) << text;
    EXPECT_EQ(g.status().message(), error) << text;
  }
}

// QEMU 7.2's file-posix checks, after open(2) (iotest 226): `file` takes
// regular files only, host_device and host_cdrom devices only; a directory
// opened read-write fails in open(2) already. A device named without a
// driver is a host_device node.
TEST_F(OpenGraphTest, FileAndDeviceDriversCheckTheKindOfFile) {
  EXPECT_EQ(Result("driver=file,filename=" + dir_),
            "'file' driver requires '" + dir_ + "' to be a regular file");
  EXPECT_EQ(Result("driver=file,filename=" + dir_, /*read_only=*/false),
            "Could not open '" + dir_ + "': Is a directory");
  EXPECT_EQ(Result("driver=file,filename=/dev/null,locking=off"),
            "'file' driver requires '/dev/null' to be a regular file");
  EXPECT_EQ(Result("driver=file,filename=/dev/null", /*read_only=*/false),
            "'file' driver requires '/dev/null' to be a regular file");
  for (const char* driver : {"host_device", "host_cdrom"}) {
    EXPECT_EQ(Result(absl::StrCat("driver=", driver, ",filename=", dir_)),
              absl::StrCat("'", driver, "' driver requires '", dir_,
                           "' to be either a character or block device"));
    EXPECT_EQ(Result(absl::StrCat("driver=", driver, ",filename=", dir_),
                     /*read_only=*/false),
              "Could not open '" + dir_ + "': Is a directory");
    EXPECT_EQ(Result(absl::StrCat("driver=", driver, ",filename=", raw_)),
              absl::StrCat("'", driver, "' driver requires '", raw_,
                           "' to be either a character or block device"));
    EXPECT_EQ(Result(absl::StrCat("driver=", driver,
                                  ",filename=/dev/null,locking=off"),
                     /*read_only=*/false),
              absl::StrCat("ok: /dev/null ", driver));
    EXPECT_EQ(Result(absl::StrCat("driver=", driver, ",filename=")),
              absl::StrCat("The '", driver,
                           "' block driver requires a file name"));
  }
  EXPECT_EQ(Result("driver=raw,file.filename=/dev/null,file.locking=off"),
            "ok: /dev/null raw");
  absl::StatusOr<NodeOptions> plain = ImageOptions("/dev/null", "", false);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->children.at("file").values.at("driver"), "host_device");
  absl::StatusOr<NodeOptions> prefixed =
      ImageOptions("host_device:/dev/null", "raw", false);
  ASSERT_TRUE(prefixed.ok()) << prefixed.status();
  EXPECT_EQ(prefixed->children.at("file").values.at("driver"), "host_device");
  EXPECT_EQ(prefixed->children.at("file").values.at("filename"), "/dev/null");
  absl::StatusOr<NodeOptions> as_file = ImageOptions("/dev/null", "file", false);
  ASSERT_TRUE(as_file.ok()) << as_file.status();
  EXPECT_EQ(as_file->values.at("driver"), "file");
}

TEST_F(OpenGraphTest, ReadOnlyAndForceShareOptions) {
  const std::string q = qcow2_;
  EXPECT_EQ(Result("driver=qcow2,file.filename=" + q + ",read-only=on",
                   /*read_only=*/false),
            "Block node is read-only");
  EXPECT_EQ(Result("driver=qcow2,file.filename=" + q + ",file.read-only=on",
                   /*read_only=*/false),
            "Block node is read-only");
  EXPECT_EQ(Result("driver=qcow2,file.filename=" + q + ",force-share=on",
                   /*read_only=*/false),
            "force-share=on can only be used with read-only images");
  EXPECT_EQ(Result("driver=qcow2,file.filename=" + q + ",force-share=on"),
            "ok: " + q + " qcow2");
}

TEST_F(OpenGraphTest, OpensBackingChainsThroughTheRegistry) {
  absl::StatusOr<OpenedGraph> g = Open("driver=qcow2,file.filename=" +
                                       overlay_);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_NE(g->qcow2, nullptr);
  io::BlockNode* backing = g->node->backing();
  ASSERT_NE(backing, nullptr);
  EXPECT_EQ(g->node_names.at(backing), qcow2_);
  EXPECT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());

  absl::StatusOr<OpenedGraph> alone = Open(
      "driver=qcow2,file.filename=" + overlay_, true, /*no_backing=*/true);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->node->backing(), nullptr);
  EXPECT_TRUE(io::RunSync(*engine_, alone->node->Close()).ok());

  // backing.* options override the stored backing file (QEMU's
  // bdrv_open_backing_file); backing=NODE names a node.
  absl::StatusOr<OpenedGraph> raw = Open("driver=qcow2,file.filename=" +
                                         overlay_ + ",backing.file.filename=" +
                                         raw_ + ",backing.driver=raw");
  ASSERT_TRUE(raw.ok()) << raw.status();
  ASSERT_NE(raw->node->backing(), nullptr);
  EXPECT_EQ(raw->node_names.at(raw->node->backing()), raw_);
  EXPECT_TRUE(io::RunSync(*engine_, raw->node->Close()).ok());
  EXPECT_EQ(Result("driver=qcow2,file.filename=" + overlay_ + ",backing=x"),
            "Could not open backing file: Cannot find device='x' nor "
            "node-name='x'");
  EXPECT_EQ(Result("driver=qcow2,file.filename=" + overlay_ +
                   ",backing.foo=1"),
            "Could not open backing file: Block format 'qcow2' does not "
            "support the option 'foo'");
}

TEST_F(OpenGraphTest, EmptyBackingOpensWithoutBackingFile) {
  std::string warnings;
  absl::StatusOr<NodeOptions> options = ImageOptions(
      "driver=qcow2,backing=,file.filename=" + overlay_, "", true);
  ASSERT_TRUE(options.ok());
  OpenSettings s;
  s.engine = engine_.get();
  s.err = &err_;
  s.warn = [&warnings](absl::string_view w) { absl::StrAppend(&warnings, w); };
  absl::StatusOr<OpenedGraph> g =
      io::RunSync(*engine_, OpenGraph(*std::move(options), s));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->node->backing(), nullptr);
  EXPECT_EQ(g->display_name, overlay_);
  EXPECT_EQ(warnings,
            "Use of \"backing\": \"\" is deprecated; use \"backing\": null "
            "instead");
  EXPECT_TRUE(io::RunSync(*engine_, g->node->Close()).ok());
}

TEST_F(OpenGraphTest, RefusesBackingFilesThatLoop) {
  const std::string loop = dir_ + "/reg_loop.qcow2";
  ASSERT_EQ(std::system(absl::StrCat("qemu-img create -q -f qcow2 ", loop,
                                     " 1M && qemu-img rebase -u -b "
                                     "reg_loop.qcow2 -F qcow2 ",
                                     loop)
                            .c_str()),
            0);
  EXPECT_EQ(Result("driver=qcow2,file.filename=" + loop),
            "Could not open backing file: Backing file '" + loop +
                "' creates an infinite loop.");
}

TEST(CheckNodeOptionsTest, ChecksOneNodeWithoutOpeningIt) {
  EXPECT_TRUE(CheckNodeOptions(Opts("driver=qcow2,l2-cache-size=1M,"
                                    "file.filename=nonexist"),
                               true, false)
                  .ok());
  EXPECT_EQ(CheckNodeOptions(Opts("driver=qcow2,foo=1"), true, false)
                .message(),
            "Block format 'qcow2' does not support the option 'foo'");
  EXPECT_EQ(CheckNodeOptions(Opts("driver=raw,foo=1"), true, false).message(),
            "Block format 'raw' does not support the option 'foo'");
  EXPECT_EQ(CheckNodeOptions(Opts("driver=qcow2,read-only=on"), false, false)
                .message(),
            "Block node is read-only");
  EXPECT_EQ(CheckNodeOptions(Opts("driver=qcow2,lazy-refcounts=x"), true,
                             false)
                .message(),
            "Parameter 'lazy-refcounts' expects 'on' or 'off'");
}

}  // namespace
}  // namespace imgtool::block
