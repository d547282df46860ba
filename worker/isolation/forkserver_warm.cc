// coderunner nsjail fork server: what nsjail's config parsing sets up once, done before any fork.
//
// nsjail reads its config file by trying it as ProtoJSON and then as text protobuf
// (config.cc). Both build state on first use and keep it for the process: the descriptors
// of NsJailConfig and its nested messages, and the JSON side's type resolver. In a process
// that parses one config and exits, that is every jail's cost (about 0.4 ms of CPU here);
// done once in the fork server, every child inherits it ready. Only protobuf's own
// process-wide caches are touched: the messages parsed here are locals, and nsjail's own
// state (its flags, its parsed config) is first built in each child.
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>

#include "config.pb.h"

extern "C" void nsjail_warm_config_parsers(void) {
	nsjail::NsJailConfig config;
	(void)google::protobuf::util::JsonStringToMessage("{}", &config);
	(void)google::protobuf::TextFormat::ParseFromString("", &config);
}
