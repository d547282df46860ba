// coderunner nsjail fork server: what nsjail builds from its config, built once, before any fork.
//
// nsjail reads its config file by trying it as ProtoJSON and then as text protobuf
// (config.cc), then compiles the config's seccomp policy with kafel (sandbox.cc). A process
// that parses one config and exits paid all of it for every jail: protobuf's process-wide
// set-up (the descriptors of NsJailConfig and its nested messages, the JSON side's type
// resolver: about 0.4 ms of CPU here), then the two parses and the compile themselves
// (about 0.7 ms more, measured with perf over 150 forks of /bin/true in the jobs' profile).
//
// nsjail_warm_config_parsers() does the set-up once, and loads glibc's user and group lookup
// modules, which nsjail's --user and --group lookups would load again in every child.
// nsjail_cache_config(path), called by the server before it forks for a request naming
// `--config path`, keeps that file's bytes, what parsing them gives, and the seccomp program
// the parsed policy compiles to (it reads the file again only when stat says it changed).
// A child then reads the file as it always does, and only when the bytes are the ones kept
// does it take the kept message (through nsjail's own parseInternal, which puts it into the
// jail's settings and applies its log settings, exactly as after a parse) and a copy of the
// kept program (for the exact policy text nsjail would compile, after every flag has had its
// say). Any other file, or a changed one, is parsed and compiled in the child as before.
// The wrapped functions are nsjail's own, renamed by the linker for the fork server only
// (scripts/build-nsjail.sh: --wrap); the nsjail binary is untouched.
#include <linux/filter.h>

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include "config.pb.h"
#include "kafel.h"
#include "nsjail.h"

namespace config {
bool parseInternal(nsj_t* nsj, const nsjail::NsJailConfig& njc); /* (made extern by build-nsjail.sh) */
}  // namespace config

extern "C" bool __real__ZN6config9parseFileEP5nsj_tPKc(nsj_t* nsj, const char* file);
extern "C" bool __real__ZN7sandbox13preparePolicyEP5nsj_t(nsj_t* nsj);

namespace {

struct KeptConfig {
	struct stat seen;  // the file when its bytes were read
	std::string bytes;
	nsjail::NsJailConfig config;
	std::string policy;  // the text kafel compiled to `program` (none: no policy, or none compiled)
	std::vector<sock_filter> program;
};

std::map<std::string, KeptConfig> configs;  // by the path as the request names it

class Quiet : public google::protobuf::io::ErrorCollector {
	void AddError(int, int, const std::string&) override {}
};

bool unchanged(const struct stat& a, const struct stat& b) {
	return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
	       a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec &&
	       a.st_ctim.tv_sec == b.st_ctim.tv_sec && a.st_ctim.tv_nsec == b.st_ctim.tv_nsec;
}

// The file's bytes, and (with `seen`) its stat as read.
bool read_file(const char* path, std::string* bytes, struct stat* seen = nullptr) {
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) return false;
	if (seen != nullptr && fstat(fd, seen) != 0) {
		close(fd);
		return false;
	}
	bytes->clear();
	char chunk[65536];
	ssize_t got;
	while ((got = read(fd, chunk, sizeof chunk)) > 0) bytes->append(chunk, static_cast<size_t>(got));
	close(fd);
	return got == 0;
}

// What sandbox::preparePolicy hands kafel for the config's seccomp_string lines.
std::string policy_text(const nsjail::NsJailConfig& config) {
	std::string text;
	for (const auto& line : config.seccomp_string()) {
		text += line;
		text += '\n';
	}
	return text;
}

bool policy_from_strings(const nsjail::NsJailConfig& config) {
	return config.seccomp_policy_file().empty() && !config.seccomp_string().empty();
}

bool compile_policy(const std::string& text, std::vector<sock_filter>* program) {
	kafel_ctxt_t ctxt = kafel_ctxt_create();
	kafel_set_input_string(ctxt, text.c_str());
	sock_fprog compiled{};
	bool ok = kafel_compile(ctxt, &compiled) == 0;
	if (ok) {
		program->assign(compiled.filter, compiled.filter + compiled.len);
		free(compiled.filter);
	}
	kafel_ctxt_destroy(&ctxt);
	return ok;
}

}  // namespace

extern "C" void nsjail_warm_config_parsers(void) {
	nsjail::NsJailConfig config;
	(void)google::protobuf::util::JsonStringToMessage("{}", &config);
	(void)google::protobuf::TextFormat::ParseFromString("", &config);
	// nsjail looks its --user and --group up by name first (user.cc), ids included: glibc
	// then reads nsswitch.conf and loads every module it names for a name no file has (here
	// libnss_systemd, with libcap and libm), once a process. A name nobody has, looked up
	// here, loads them all, and every child finds them loaded.
	(void)getpwnam("coderunner-no-such-user");
	(void)getgrnam("coderunner-no-such-group");
}

extern "C" void nsjail_cache_config(const char* path) {
	struct stat now;
	auto kept = configs.find(path);
	if (kept != configs.end() && stat(path, &now) == 0 && unchanged(kept->second.seen, now)) return;
	KeptConfig entry;
	if (!read_file(path, &entry.bytes, &entry.seen) || entry.bytes.empty()) {
		configs.erase(path);
		return;
	}
	if (kept != configs.end() && kept->second.bytes == entry.bytes) {
		kept->second.seen = entry.seen;  // (touched, not changed)
		return;
	}
	// Accepted as config::parseFile accepts it: as exactly one of the two formats. Anything
	// else is not kept, and the child's own parse says what is wrong (once, in its log).
	nsjail::NsJailConfig json;
	bool json_ok = google::protobuf::util::JsonStringToMessage(entry.bytes, &json).ok();
	Quiet quiet;
	google::protobuf::TextFormat::Parser parser;
	parser.RecordErrorsTo(&quiet);
	bool text_ok = parser.ParseFromString(entry.bytes, &entry.config);
	if (json_ok == text_ok) {
		configs.erase(path);
		return;
	}
	if (json_ok) entry.config = std::move(json);
	if (policy_from_strings(entry.config)) {
		entry.policy = policy_text(entry.config);
		if (!compile_policy(entry.policy, &entry.program)) entry.policy.clear();
	}
	configs[path] = std::move(entry);
}

// config::parseFile, in the fork server's children.
extern "C" bool __wrap__ZN6config9parseFileEP5nsj_tPKc(nsj_t* nsj, const char* file) {
	auto kept = configs.find(file);
	std::string bytes;
	if (kept != configs.end() && read_file(file, &bytes) && bytes == kept->second.bytes) {
		return config::parseInternal(nsj, kept->second.config);
	}
	return __real__ZN6config9parseFileEP5nsj_tPKc(nsj, file);
}

// sandbox::preparePolicy, in the fork server's children.
extern "C" bool __wrap__ZN7sandbox13preparePolicyEP5nsj_t(nsj_t* nsj) {
	if (policy_from_strings(nsj->njc)) {
		std::string text = policy_text(nsj->njc);
		for (const auto& [path, kept] : configs) {
			if (kept.policy.empty() || kept.policy != text) continue;
			size_t bytes = kept.program.size() * sizeof(sock_filter);
			auto* filter = static_cast<sock_filter*>(malloc(bytes));
			if (filter == nullptr) break;
			memcpy(filter, kept.program.data(), bytes);
			nsj->seccomp_fprog.filter = filter;
			nsj->seccomp_fprog.len = static_cast<unsigned short>(kept.program.size());
			return true;
		}
	}
	return __real__ZN7sandbox13preparePolicyEP5nsj_t(nsj);
}
