{{/* The torchrun container of the train stage (Indexed Job or JobSet): node rank = completion index. */}}
{{- define "sapd.trainPodSpec" -}}
{{- $c := .c }}
{{- $t := .root.Values.train }}
{{- $gpus := (($t.resources.limits | default dict) | dig "nvidia.com/gpu" 0) | int }}
{{- if and (gt $gpus 0) (ne $gpus (int $t.procsPerPod)) }}
{{- fail (printf "train.procsPerPod (%d) must equal the GPUs each train pod requests (%d)" (int $t.procsPerPod) $gpus) }}
{{- end }}
{{- include "sapd.podCommon" $c }}
{{- with .subdomain }}
subdomain: {{ . }}
{{- end }}
containers:
  - name: train
    {{- include "sapd.containerCommon" $c | nindent 4 }}
    args:
      - torchrun
      - --nnodes={{ int $t.parallelism }}
      - --nproc-per-node={{ int $t.procsPerPod }}
      - --node-rank=$(NODE_RANK)
      - --master-addr={{ .masterAddr }}
      - --master-port={{ int $t.rendezvousPort }}
      # every pod waits this long for the whole group (torchrun's static rendezvous: 600 s by default)
      - --rdzv-conf=timeout={{ int $t.rendezvousTimeoutSeconds }}
      - -m
      - sapd.jobs.train
      - --config
      - /etc/sapd/config.yaml
      - --round
      - {{ .round | quote }}
      {{- range include "sapd.workerArgs" . | fromJsonArray }}
      - {{ . | quote }}
      {{- end }}
    ports:
      - name: rendezvous
        containerPort: {{ int $t.rendezvousPort }}
      - name: metrics
        containerPort: {{ int $t.metricsPort }}
    env:
      {{- include "sapd.env" $c | nindent 6 }}
{{- end -}}

{{- define "sapd.trainEnv" -}}
{{- $t := .root.Values.train }}
{{- if or (eq (include "sapd.trainEngine" (dict "root" .root "job" $t)) "deepspeed") (gt (int $t.procsPerPod) 1) (gt (int $t.parallelism) 1) }}
# OpenMP threads that spin while waiting starve DeepSpeed's and gloo's own threads when a rank's
# threads take every CPU core (a tiny model's steps ran 15-20x slower on CPU: docs/results/STAGES.md).
# One torch-engine process alone has no such threads, and passive waits cost its CPU steps ~40 %.
- name: OMP_WAIT_POLICY
  value: PASSIVE
{{- end }}
- name: NODE_RANK
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
- name: SAPD_METRICS_PORT
  value: {{ .root.Values.train.metricsPort | quote }}
- name: SAPD_METRICS_ADDR
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{- define "sapd.trainJob" -}}
{{- if eq .root.Values.train.launcher "jobset" }}
{{- include "sapd.trainJobSet" . }}
{{- else }}
{{- $nodes := int .root.Values.train.parallelism }}
{{- $c := dict "root" .root "component" "train" "job" .root.Values.train "round" .round "gang" true "manyProcesses" (gt (int .root.Values.train.procsPerPod) 1) "hostSuffix" (add 1 (len (toString (sub $nodes 1)))) }}
{{- $_ := set $c "env" (include "sapd.trainEnv" $c | fromYamlArray) }}
{{- $svc := include "sapd.name" (dict "root" .root "component" "train") }}
{{- $name := include "sapd.stageName" $c }}
# Indexed Job of `parallelism` torchrun pods: node rank = completion index; the rendezvous is pod 0
# (hostname <job>-0) through the headless Service. backoffLimit 0: one failed pod fails the Job and the
# driver recreates the whole group (a static torchrun rendezvous cannot take one replaced rank); a
# preempted pod fails it too (podFailurePolicy rule 0), and that restart is not counted.
apiVersion: batch/v1
kind: Job
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  completionMode: Indexed
  completions: {{ $nodes }}
  parallelism: {{ $nodes }}
  {{- include "sapd.batchFields" $c | trim | nindent 2 }}
  template:
    metadata:
      {{- include "sapd.podMeta" $c | nindent 6 }}
    spec:
      {{- include "sapd.trainPodSpec" (dict "root" .root "c" $c "round" .round "subdomain" $svc "masterAddr" (printf "%s-0.%s" $name $svc)) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* The train stage as a JobSet (jobset.x-k8s.io/v1alpha2): one replicated Job "node" of `parallelism`
     Indexed pods; JobSet creates the headless Service (named after the JobSet) and restarts the whole
     group up to `maxRestarts` times. The child Job's podFailurePolicy fails it on a preempted pod (rule 0)
     or exit code 2 (rule 1), and JobSet's rules tell the two apart by the rule index in the failure
     message (onJobFailureMessagePatterns, JobSet >= 0.10; its host-maintenance pattern): a preemption
     restarts the group without counting against maxRestarts, exit code 2 fails the JobSet at once. */}}
{{- define "sapd.trainJobSet" -}}
{{- $nodes := int .root.Values.train.parallelism }}
{{- $c := dict "root" .root "component" "train" "job" .root.Values.train "round" .round "gang" true "manyProcesses" (gt (int .root.Values.train.procsPerPod) 1) "hostSuffix" (add 8 (len (toString (sub $nodes 1)))) }}
{{- $_ := set $c "env" (include "sapd.trainEnv" $c | fromYamlArray) }}
{{- $name := include "sapd.stageName" $c }}
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  {{- include "sapd.stageMeta" $c | nindent 2 }}
spec:
  ttlSecondsAfterFinished: {{ int .root.Values.train.ttlSecondsAfterFinished }}
  failurePolicy:
    maxRestarts: {{ int .root.Values.train.maxRestarts }}
    rules:
      - name: preempted
        action: RestartJobSetAndIgnoreMaxRestarts
        onJobFailureReasons: [PodFailurePolicy]
        onJobFailureMessagePatterns: ["matching FailJob rule at index 0$"]
      - name: permanent-error
        action: FailJobSet
        onJobFailureReasons: [PodFailurePolicy]
        onJobFailureMessagePatterns: ["matching FailJob rule at index 1$"]
  network:
    enableDNSHostnames: true
    publishNotReadyAddresses: true
  replicatedJobs:
    - name: node
      replicas: 1
      template:
        metadata:
          labels:
            {{- include "sapd.labels" $c | nindent 12 }}
            sapd.io/round: {{ .round | quote }}
        spec:
          completionMode: Indexed
          completions: {{ $nodes }}
          parallelism: {{ $nodes }}
          {{- include "sapd.batchFields" $c | trim | nindent 10 }}
          template:
            metadata:
              {{- include "sapd.podMeta" $c | nindent 14 }}
            spec:
              {{- include "sapd.trainPodSpec" (dict "root" .root "c" $c "round" .round "masterAddr" (printf "%s-node-0-0.%s" $name $name)) | nindent 14 }}
{{- end -}}

{{- define "sapd.trainService" -}}
{{- $c := dict "root" .root "component" "train" }}
# Headless Service: gives every train pod a DNS name (<job>-<index>.<service>) so torchrun on each pod
# reaches the rendezvous on pod 0, and Prometheus finds rank 0's /metrics.
apiVersion: v1
kind: Service
metadata:
  name: {{ include "sapd.name" $c }}
  labels:
    {{- include "sapd.labels" $c | nindent 4 }}
spec:
  clusterIP: None
  # pods must resolve each other before any is Ready: rendezvous happens during startup
  publishNotReadyAddresses: true
  selector:
    {{- include "sapd.selectorLabels" $c | nindent 4 }}
  ports:
    - name: rendezvous
      port: {{ int .root.Values.train.rendezvousPort }}
      targetPort: rendezvous
    - name: metrics
      port: {{ int .root.Values.train.metricsPort }}
      targetPort: metrics
{{- end -}}
